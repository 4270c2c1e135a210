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
//!
//! **Layout.** This file is the replicator's public face, its state and the replicate path;
//! `link_watch` follows each backup's link (answers, failures, recovery), `catch_up_pump`
//! starts catch-ups and sends their chunks, and `stats` is what `/metrics` reads.

mod catch_up_pump;
mod link_watch;
mod stats;

pub use stats::{BackupReplication, CatchUpProgress, QueueReplication, ReplicationStats};

use stats::Counters;

use super::REPLICATION_EXCHANGE;
use super::catch_up::{CatchUp, CatchUpLimits, OpsFrame, Phase};
use super::codec::{Frame, op_len};
use super::ledger::Ledger;
use crate::core::VHost;
use crate::core::message::{DiskBody, Message};
use crate::core::ops::{OpKind, QueueOp};
use crate::proxy::forward::{ForwardTracker, Forwarders, Job};
use crate::proxy::link::Links;
use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
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
    /// Whether every member reads replicated deliveries that name their session (a rolling
    /// upgrade may still have members that do not, which would refuse such a frame): until
    /// then the stream leaves the sessions out.
    fn names_sessions(&self) -> bool;
    /// Reads paged-out bodies back from the journal, in `keys` order; `None` for a body
    /// whose record is gone (its message left the queue since). Blocking I/O: call it off
    /// the async workers and outside the vhost lock.
    fn read_paged(&self, keys: &[DiskBody]) -> Result<Vec<Option<Bytes>>, String>;
}

/// What a frame about to go to one backup is, for the watcher of that backup's link.
#[derive(Debug)]
struct Outgoing {
    /// The queue whose ops or image it carries.
    queue: Arc<str>,
    /// Its queue ops (an image chunk: its messages), for the lag `/metrics` reports.
    ops: u32,
    /// The batch it belongs to.
    stamp: u64,
    /// The last frame of a catch-up (its attempt): once confirmed, the backup is in sync for
    /// the queue — if that attempt is still the current one.
    image: Option<u64>,
}

/// A frame on its way to one backup, until the backup answers it. The per-queue lag on
/// `/metrics` is summed from these at scrape time, so the replicate path keeps no counter
/// of its own.
#[derive(Debug)]
struct Sent {
    /// The tracker's number for it.
    id: u64,
    /// Its encoded bytes.
    bytes: u64,
    /// What it is.
    what: Outgoing,
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

    /// The stamp up to which every in-sync backup acknowledged: a connection's confirms of
    /// a batch stamped `s` go out once this reaches `s`.
    pub fn acked(&self) -> watch::Receiver<u64> {
        self.acked.subscribe()
    }

    /// The stamp of the newest batch handed over: once [`Replicator::acked`] reaches it,
    /// every in-sync backup holds every op made so far.
    pub fn issued(&self) -> u64 {
        self.state.lock().ledger.issued()
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
        let names_sessions = host.names_sessions();
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
                        ops: if names_sessions {
                            rest[..n].to_vec()
                        } else {
                            rest[..n].iter().map(without_session).collect()
                        },
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
            let Frame::Ops { queue, ops, .. } = &frame else {
                unreachable!("replicate builds ops frames only");
            };
            let queue = queue.clone();
            let ops = u32::try_from(ops.len()).unwrap_or(u32::MAX);
            // An enqueue carries the message as published, in memory; should one not, the
            // backups miss these ops, refuse the next ones, and are caught up again.
            let message = match encode(&frame) {
                Ok(message) => OpsFrame { message, ops },
                Err(e) => {
                    tracing::error!(vhost, error = %e, "replication frame not sent");
                    continue;
                }
            };
            for backup in &roles.backups {
                if self.divert(&mut state, vhost, backup, &queue, &message, now) {
                    continue;
                }
                let what = Outgoing {
                    queue: queue.clone(),
                    ops,
                    stamp,
                    image: None,
                };
                if let Some(job) = self.frame_job(
                    &mut state,
                    vhost,
                    backup,
                    &message.message,
                    what,
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
        message: &OpsFrame,
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
    /// queue, or one the map put out of sync, starts a catch-up from an image taken now, so
    /// the stream continues right after the image.
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
        let (old_backups, old_in_sync) =
            before.map_or_else(Default::default, |r| (r.backups, r.in_sync));
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
            for backup in roles.backups.iter().filter(|b| !roles.in_sync.contains(b)) {
                // A new backup, or one the map put out of sync while it stayed a backup (its
                // member restarted in place: what it held in memory is gone). The second
                // needs a catch-up of its own when its link never saw a failure — an idle
                // link's does not reach the watcher, which would otherwise start it.
                let dropped = old_in_sync.contains(backup)
                    && !(state.links.get(&(backup.clone(), vhost.clone())))
                        .is_some_and(|l| l.catch_ups.contains_key(&name));
                if old_backups.contains(backup) && !dropped {
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

    /// A job carrying `frame` (encoded by [`encode`]) to `backup`, registered with its link
    /// as `what` (`None` when the link is broken: its catch-up will send an image instead).
    fn frame_job(
        &self,
        state: &mut State,
        vhost: &str,
        backup: &str,
        frame: &Arc<Message>,
        what: Outgoing,
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
        let bytes = frame.body_len() as u64;
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        link.sent.push_back(Sent { id, bytes, what });
        Some(Job {
            exchange: REPLICATION_EXCHANGE.into(),
            routing_key: "".into(),
            message: frame.clone(),
            ticket: Some((link.tracker.clone(), id)),
            after_index,
            origin: None,
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
}

/// `op` without the session a delivery names, for a member that cannot read it.
fn without_session(op: &QueueOp) -> QueueOp {
    let mut op = op.clone();
    if let OpKind::Deliver { session, .. } = &mut op.kind {
        *session = None;
    }
    op
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
