//! A running CPG member: the [`Cpg`] handle the application holds, the [`CpgEvents`] stream it
//! reads, and the background duties (admission, lease renewal, failure detection).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, Raft, SnapshotPolicy};
use parking_lot::Mutex;
use rand08::RngCore;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::config::CpgConfig;
use super::disk::{DirDisk, Disk};
use super::error::{CpgError, StopReason};
use super::event::CpgEvent;
use super::lease::Lease;
use super::log_store::LogStore;
use super::network::NetworkFactory;
use super::runtime::CpgRng;
use super::service::Service;
use super::state_machine::{self, EventSink, Snapshots, StateMachine};
use super::tcp::{self, TcpTransport};
use super::transport::Transport;
use super::types::{Command, CpgTypes, MemberId, Outcome};
use super::wire::{Envelope, Request, Response};
use crate::atomic_file::write_atomically;

/// Handle to a running CPG member. Cheap to clone; the member runs until
/// [`Cpg::shutdown`], until it is evicted or overrun, or until every clone is dropped (which is
/// the same as a crash to the other members).
#[derive(Clone)]
pub struct Cpg {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) id: MemberId,
    pub(super) addr: String,
    pub(super) config: CpgConfig,
    pub(super) raft: Raft<CpgTypes>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) lease: Arc<Mutex<Lease>>,
    pub(super) quorum_tx: watch::Sender<bool>,
    pub(super) stop: Arc<watch::Sender<Option<StopReason>>>,
    /// Voters declared failed, as of this member's applied log.
    pub(super) failed: Arc<Mutex<BTreeSet<MemberId>>>,
    /// Consensus has stopped too (see [`Cpg::is_retired`]).
    pub(super) retired: AtomicBool,
    pub(super) tasks: Mutex<Vec<JoinHandle<()>>>,
    /// This process's incarnation (random per start; see [`Command::Start`]).
    pub(super) incarnation: u64,
    /// Index of this incarnation's start once applied here, 0 before.
    pub(super) started: Arc<AtomicU64>,
    /// Events handed to the application so far.
    pub(super) events_sent: Arc<AtomicU64>,
    /// The member's snapshots (and, with a disk, which one a restart starts from).
    pub(super) snapshots: Arc<Snapshots>,
    /// It found consensus state of its own on disk: it is a restarted member.
    pub(super) restarted: bool,
    /// Its consensus state is on a disk (a restart is the same member).
    pub(super) durable: bool,
    /// Its application's state is older than what its log holds: it must start afresh.
    pub(super) reset: bool,
    /// The simulation froze it (a SIGSTOP): its background duties do not run.
    #[cfg(test)]
    pub(super) paused: AtomicBool,
}

impl Drop for Inner {
    /// Dropping the last handle is a crash as far as the other members can tell: tasks stop
    /// at once and consensus shuts down in the background.
    fn drop(&mut self) {
        for t in self.tasks.get_mut().drain(..) {
            t.abort();
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let raft = self.raft.clone();
            rt.spawn(async move {
                // An error means it had already stopped.
                let _ = raft.shutdown().await;
            });
        }
    }
}

/// The ordered stream of this member's events (all its groups interleaved in agreed order).
pub struct CpgEvents {
    rx: mpsc::Receiver<CpgEvent>,
    stop: watch::Receiver<Option<StopReason>>,
    received: u64,
}

impl CpgEvents {
    /// How many events [`CpgEvents::recv`] has returned: compare with [`SyncPoint::events`].
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The next event; `None` once the member has stopped and every event queued before that
    /// has been returned ([`Cpg::stop_reason`] then tells why).
    pub async fn recv(&mut self) -> Option<CpgEvent> {
        let ev = self.next().await;
        self.received += u64::from(ev.is_some());
        ev
    }

    async fn next(&mut self) -> Option<CpgEvent> {
        loop {
            if let Ok(ev) = self.rx.try_recv() {
                return Some(ev);
            }
            if self.stop.borrow().is_some() {
                return None;
            }
            tokio::select! {
                biased;
                ev = self.rx.recv() => return ev,
                changed = self.stop.changed() => {
                    if changed.is_err() {
                        return None;
                    }
                }
            }
        }
    }
}

/// Where the newest committed state was, as of a [`Cpg::sync`]: every event up to it is
/// applied here and queued for the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncPoint {
    /// The read index: the newest committed index a majority confirmed.
    pub index: u64,
    /// Events queued for the application by then: once [`CpgEvents::received`] reaches it,
    /// the application has seen everything up to `index`.
    pub events: u64,
}

/// A member built but not yet serving or admitted; the transport-specific start finishes it.
pub(crate) struct Launched {
    pub cpg: Cpg,
    pub events: CpgEvents,
    pub service: Arc<Service>,
}

fn raft_config(c: &CpgConfig) -> Result<Arc<openraft::Config>, CpgError> {
    let rc = openraft::Config {
        cluster_name: "ringmq-cpg".into(),
        heartbeat_interval: c.heartbeat_ms,
        election_timeout_min: c.election_timeout_ms,
        election_timeout_max: 2 * c.election_timeout_ms,
        install_snapshot_timeout: c.rpc_timeout_ms.saturating_mul(4),
        max_payload_entries: c.max_entries_per_append,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(c.log_keep_entries.max(1)),
        max_in_snapshot_log_to_keep: c.log_keep_entries,
        ..Default::default()
    };
    rc.validate()
        .map(Arc::new)
        .map_err(|e| CpgError::Config(e.to_string()))
}

/// How long a restarted process calls no election: openraft's leader lease plus its longest
/// election timeout (`2 × election_timeout_ms` each), what a follower that has just heard a
/// leader waits before it calls one.
fn quiet_after_restart(c: &CpgConfig) -> Duration {
    Duration::from_millis(c.election_timeout_ms.saturating_mul(4))
}

/// How long a join, leave or multicast may wait for its commit.
pub(super) fn write_timeout(c: &CpgConfig) -> Duration {
    Duration::from_millis(c.failure_timeout_ms.saturating_mul(2))
}

impl Cpg {
    /// Starts a member on a real TCP cluster port: binds `config.listen`, then founds a cluster
    /// (no seeds) or is admitted through a seed. Returns once admitted, with the handle and the
    /// member's event stream.
    pub async fn start(config: CpgConfig) -> Result<(Cpg, CpgEvents), CpgError> {
        config.validate()?;
        let bind_err = |e: std::io::Error| CpgError::Bind {
            addr: config.listen.to_string(),
            reason: e.to_string(),
        };
        let listener = TcpListener::bind(config.listen).await.map_err(bind_err)?;
        let bound = listener.local_addr().map_err(bind_err)?;
        let addr = config
            .advertise
            .clone()
            .unwrap_or_else(|| bound.to_string());
        let secret = Arc::new(config.secret.clone());
        let transport = Arc::new(TcpTransport::new(
            Arc::clone(&secret),
            config.max_frame_bytes,
        ));
        let (id, disk) = match &config.data_dir {
            Some(dir) => {
                let (id, disk) = open_data_dir(dir)?;
                (id, Some(disk))
            }
            None => (CpgRng.next_u64(), None),
        };
        let launched = Self::launch(config.clone(), id, addr, transport, disk).await?;
        let server = tokio::spawn(tcp::serve(
            listener,
            Arc::clone(&launched.service),
            secret,
            config.max_frame_bytes,
            Duration::from_millis(config.rpc_timeout_ms.saturating_mul(4)),
        ));
        launched.cpg.inner.tasks.lock().push(server);
        launched.cpg.boot().await?;
        Ok((launched.cpg, launched.events))
    }

    /// Brings a launched member into its cluster: a new member founds it or is admitted
    /// (returning once it is); a restarted one never founds, and reaches the others in the
    /// background. Either way its incarnation then starts ([`CpgEvent::Started`]).
    pub(crate) async fn boot(&self) -> Result<(), CpgError> {
        if self.inner.restarted {
            tracing::info!(
                member = self.inner.id,
                "restarting on this member's consensus state: waiting for a majority of its last configuration"
            );
        } else {
            self.admit().await?;
        }
        self.spawn_monitor();
        self.spawn_start();
        Ok(())
    }

    /// Builds member `id` at `addr` over `transport`, without serving or joining yet.
    pub(crate) async fn launch(
        config: CpgConfig,
        id: MemberId,
        addr: String,
        transport: Arc<dyn Transport>,
        disk: Option<Arc<dyn Disk>>,
    ) -> Result<Launched, CpgError> {
        config.validate()?;
        let raft_config = raft_config(&config)?;
        let (tx, rx) = mpsc::channel(config.event_queue_len);
        let stop = Arc::new(watch::channel(None).0);
        let failed = Arc::new(Mutex::new(BTreeSet::new()));
        let storage_err = |reason: String| CpgError::Storage {
            dir: config
                .data_dir
                .as_ref()
                .map_or_else(|| "memory".into(), |d| d.display().to_string()),
            reason,
        };
        let recovered = match &disk {
            Some(d) => d.load().map_err(|e| storage_err(e.to_string()))?,
            None => Default::default(),
        };
        let restarted = !recovered.is_empty();
        let durable = disk.is_some();
        let purge_limit = recovered
            .snapshot
            .as_ref()
            .and_then(|s| s.meta.last_log_id)
            .map_or(0, |l| l.index + 1);
        let (log, purge_below) = match &disk {
            Some(d) => {
                let purge_below = Arc::new(AtomicU64::new(purge_limit));
                let log = LogStore::durable(Arc::clone(d), &recovered, Arc::clone(&purge_below));
                (log, purge_below)
            }
            None => {
                let log = LogStore::in_memory();
                (log, Arc::new(AtomicU64::new(u64::MAX)))
            }
        };
        let snapshots = Arc::new(Snapshots::new(
            disk.clone(),
            recovered.snapshot.clone(),
            purge_below,
            config.resume_after,
        ));
        let reset = match &recovered.snapshot {
            Some(snapshot) => state_machine::cannot_resume(snapshot, id, config.resume_after)
                .map_err(|e| storage_err(format!("the snapshot cannot be decoded: {e}")))?,
            None => false,
        };
        let incarnation = CpgRng.next_u64();
        let lease = Arc::new(Mutex::new(Lease::new(
            config.lease_ms,
            config.failure_timeout_ms,
            config.heartbeat_ms,
        )));
        let started = Arc::new(AtomicU64::new(0));
        let events_sent = Arc::new(AtomicU64::new(0));
        let sm = StateMachine::new(
            EventSink {
                local: id,
                tx,
                stop: Arc::clone(&stop),
                failed: Arc::clone(&failed),
                lease: Arc::clone(&lease),
                resume_after: config.resume_after,
                incarnation,
                started: Arc::clone(&started),
                sent: Arc::clone(&events_sent),
                reset,
            },
            Arc::clone(&snapshots),
        )
        .map_err(|e| storage_err(format!("the snapshot cannot be decoded: {e}")))?;
        let network = NetworkFactory {
            transport: Arc::clone(&transport),
            rpc_timeout: Duration::from_millis(config.rpc_timeout_ms),
            backoff: Duration::from_millis(config.heartbeat_ms),
        };
        let raft = Raft::new(id, raft_config, network, log, sm)
            .await
            .map_err(|e| storage_err(format!("openraft refused to start on it: {e}")))?;
        if restarted {
            // openraft lets a process that found a vote on disk, but has heard no leader yet,
            // call an election at its first tick; its higher term then deposes a healthy
            // leader through the others' answers (its append responses carry the higher
            // vote), and every member's lease lapses until the next leader grants one. So it
            // waits as long as a follower that just heard a leader would (see
            // `quiet_after_restart`); by then it has heard the leader, if there is one.
            raft.runtime_config().elect(false);
        }
        let (quorum_tx, _) = watch::channel(false);
        let service = Arc::new(Service::new(
            id,
            raft.clone(),
            Arc::clone(&lease),
            Arc::clone(&failed),
            write_timeout(&config),
        ));
        let events = CpgEvents {
            rx,
            stop: stop.subscribe(),
            received: 0,
        };
        let cpg = Cpg {
            inner: Arc::new(Inner {
                id,
                addr,
                config,
                raft,
                transport,
                lease,
                quorum_tx,
                stop,
                failed,
                retired: AtomicBool::new(false),
                tasks: Mutex::new(Vec::new()),
                incarnation,
                started,
                events_sent,
                snapshots,
                restarted,
                durable,
                reset,
                #[cfg(test)]
                paused: AtomicBool::new(false),
            }),
        };
        if restarted {
            let raft = cpg.inner.raft.clone();
            let quiet = quiet_after_restart(&cpg.inner.config);
            let task = tokio::spawn(async move {
                tokio::time::sleep(quiet).await;
                raft.runtime_config().elect(true);
            });
            cpg.inner.tasks.lock().push(task);
        }
        Ok(Launched {
            cpg,
            events,
            service,
        })
    }

    /// This member's id, as other members' events name it (stable across restarts on the
    /// same data directory).
    pub fn id(&self) -> MemberId {
        self.inner.id
    }

    /// The cluster address other members reach this one at (the bound port when `listen` asked
    /// for port 0).
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The consensus leader as this member last heard of it (none during an election, or
    /// when this member is cut off and has not heard of one).
    pub fn leader(&self) -> Option<MemberId> {
        self.inner.raft.metrics().borrow().current_leader
    }

    /// Notifies quorum changes: the watch turns false within a heartbeat of the lease running
    /// out. For a decision, ask [`Cpg::has_quorum_now`]: a watch read after a pause of this
    /// process may still show what was true before it.
    pub fn quorum(&self) -> watch::Receiver<bool> {
        self.inner.quorum_tx.subscribe()
    }

    /// Whether this member holds the majority's lease at this instant: its incarnation has
    /// started, it has not stopped, and the lease's deadline (the leader's own, or what the
    /// leader granted) is later than the clock now. Checked when asked, never cached, so the
    /// first question after a pause longer than the lease is answered "no".
    pub fn has_quorum_now(&self) -> bool {
        self.stop_reason().is_none()
            && self.started().is_some()
            && self.lease_deadline().is_some_and(|d| Instant::now() < d)
    }

    /// Whether this member has granted its vote to another member's candidacy that has not
    /// won yet: the consensus leader was lost and a member in contact with this one is
    /// being elected. (A member cut off from the others gets no vote request, and a
    /// candidate's vote is its own.)
    pub fn voted_for_a_candidate(&self) -> bool {
        let metrics = self.inner.raft.metrics();
        let m = metrics.borrow();
        !m.vote.is_committed() && m.vote.leader_id().voted_for() != Some(self.inner.id)
    }

    /// When this member's lease ends, if it holds one (see [`Cpg::has_quorum_now`]).
    pub fn lease_deadline(&self) -> Option<Instant> {
        let metrics = self.inner.raft.metrics();
        let applied = metrics.borrow().last_applied.map_or(0, |l| l.index);
        self.inner.lease.lock().deadline_at(applied)
    }

    /// The newest index this member has applied.
    fn applied_index(&self) -> u64 {
        self.inner
            .raft
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index)
    }

    /// The index at which this process's incarnation started, once it has (see
    /// [`CpgEvent::Started`]). Until then the member serves nothing that needs agreement.
    pub fn started(&self) -> Option<u64> {
        Some(self.inner.started.load(Ordering::Acquire)).filter(|i| *i > 0)
    }

    /// Whether this member found consensus state of its own when it started (a restart).
    pub fn is_restart(&self) -> bool {
        self.inner.restarted
    }

    /// How many voters the member's last configuration has and how many of them it can see
    /// (itself included; the others heard from within a failure timeout — a leader by their
    /// pings, a follower by the leader's answers, [`Lease::reachable`]): what a restarted or
    /// cut-off member waits for, for `/readyz`.
    ///
    /// [`Lease::reachable`]: super::lease::Lease::reachable
    pub fn voters_reachable(&self) -> (usize, usize) {
        let voters = self.voter_ids();
        let within = Duration::from_millis(self.inner.config.failure_timeout_ms);
        let reachable =
            self.inner
                .lease
                .lock()
                .reachable(self.inner.id, &voters, Instant::now(), within);
        (reachable.min(voters.len().max(1)), voters.len())
    }

    /// The application has made durable every event up to `index`: a restart of this member
    /// may resume after it, and the log before it may go.
    pub fn checkpointed(&self, index: u64) {
        self.inner.snapshots.checkpointed(index);
    }

    /// A read index: asks the leader (which confirms its leadership with a majority) for the
    /// newest committed index, and returns once this member has applied it, so that the
    /// application can act on the newest committed state rather than on what it has seen.
    pub async fn sync(&self) -> Result<SyncPoint, CpgError> {
        let timeout = write_timeout(&self.inner.config);
        let deadline = Instant::now() + timeout;
        let retry = Duration::from_millis(self.inner.config.heartbeat_ms);
        let index = loop {
            self.check_running()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CpgError::NotCommitted(
                    "no leader confirmed a read index in time".into(),
                ));
            }
            let leader = self.leader();
            if leader == Some(self.inner.id) {
                match tokio::time::timeout(left, self.inner.raft.get_read_log_id()).await {
                    Ok(Ok((read, _))) => break read.map_or(0, |l| l.index),
                    _ => tokio::time::sleep(retry).await,
                }
                continue;
            }
            let addr = leader.and_then(|l| {
                let m = self.inner.raft.metrics();
                let m = m.borrow();
                m.membership_config
                    .membership()
                    .get_node(&l)
                    .map(|n| n.addr.clone())
            });
            let Some(addr) = addr else {
                tokio::time::sleep(retry).await;
                continue;
            };
            let env = Envelope {
                to: None,
                req: Request::ReadIndex,
            };
            match self.inner.transport.call(&addr, env, left).await {
                Ok(Response::ReadIndex(i)) => break i,
                _ => tokio::time::sleep(retry).await,
            }
        };
        let left = deadline.saturating_duration_since(Instant::now());
        self.inner
            .raft
            .wait(Some(left))
            .applied_index_at_least(Some(index), "sync")
            .await
            .map_err(|e| CpgError::NotCommitted(format!("not applied in time: {e}")))?;
        Ok(SyncPoint {
            index,
            events: self.inner.events_sent.load(Ordering::Acquire),
        })
    }

    /// The log index of this member's newest membership and its voter sets (two during a joint
    /// change), for the simulation.
    #[cfg(test)]
    pub(crate) fn voters(&self) -> (u64, Vec<std::collections::BTreeSet<MemberId>>) {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        let index = m.membership_config.log_id().map_or(0, |l| l.index);
        (
            index,
            m.membership_config.membership().get_joint_config().clone(),
        )
    }

    /// Freezes (or thaws) this member's background duties, as a SIGSTOP would: for the
    /// simulation, whose network holds the member's traffic meanwhile.
    #[cfg(test)]
    pub(crate) fn set_paused(&self, paused: bool) {
        self.inner.paused.store(paused, Ordering::Release);
    }

    /// The index of the last entry in this member's log, for the simulation.
    #[cfg(test)]
    pub(crate) fn last_log_index(&self) -> u64 {
        self.inner
            .raft
            .metrics()
            .borrow()
            .last_log_index
            .unwrap_or(0)
    }

    /// One line of openraft's view of this member (for simulation failure reports).
    #[cfg(test)]
    pub(crate) fn raft_summary(&self) -> String {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        format!(
            "{:?} term {} leader {:?} last_log {:?} applied {:?} membership {:?} quorum_ack_ms {:?} stop {:?}",
            m.state,
            m.current_term,
            m.current_leader,
            m.last_log_index,
            m.last_applied.map(|l| l.index),
            m.membership_config.membership(),
            m.millis_since_quorum_ack,
            self.stop_reason()
        )
    }

    /// How many voters the newest membership this member knows has. Dead voters count until
    /// the cluster removes them (only from even sets of four or more, see `docs/cpg.md`), so
    /// after a crash the cluster is back to full strength once this is back to its size.
    pub fn voter_count(&self) -> usize {
        self.voter_ids().len()
    }

    /// The voters of the newest membership this member knows.
    fn voter_ids(&self) -> Vec<MemberId> {
        self.inner
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect()
    }

    /// Why the member stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        *self.inner.stop.borrow()
    }

    /// Whether this member's consensus has stopped too. With a disk that follows the stop at
    /// once (a restart is the same voter). Without one, a member that stopped for a reason of
    /// its own (evicted, overrun, fell behind) delivers nothing more, but its Raft node goes on
    /// voting until the cluster has removed it from the voters: dropping it at once would cost
    /// the others a vote they may need (a 3-member cluster with one partitioned member that
    /// was declared failed and another that crashed). Keep the handle until this is true if the
    /// replacement can start elsewhere; dropping it earlier is a crash to the others.
    pub fn is_retired(&self) -> bool {
        self.inner.retired.load(Ordering::Acquire)
    }

    /// Joins `group` (once this process's incarnation has started: see
    /// [`CpgEvent::Started`]); the member's first event of the group is the configuration change
    /// that lists it in `joined`.
    pub async fn join(&self, group: &str) -> Result<u64, CpgError> {
        // A join before this process's start would be ambiguous: a failure agreed between
        // the two would count as its predecessor's, leaving it in no group unawares.
        self.wait_started().await?;
        let cmd = Command::Join {
            group: group.to_string(),
            member: self.inner.id,
        };
        match self.propose(cmd).await? {
            Outcome::Applied { index } => Ok(index),
            Outcome::NotMember | Outcome::ViewChanged { .. } => {
                Err(CpgError::Stopped(StopReason::Evicted))
            }
        }
    }

    /// Waits (at most a write timeout) until this process's incarnation has started.
    async fn wait_started(&self) -> Result<(), CpgError> {
        let deadline = Instant::now() + write_timeout(&self.inner.config);
        while self.started().is_none() {
            self.check_running()?;
            if Instant::now() >= deadline {
                return Err(CpgError::NotCommitted(
                    "this member's start is not agreed yet (no majority?)".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// Leaves `group`; the last event of the group is the configuration change listing this
    /// member in `left`.
    pub async fn leave(&self, group: &str) -> Result<u64, CpgError> {
        let cmd = Command::Leave {
            group: group.to_string(),
            member: self.inner.id,
        };
        match self.propose(cmd).await? {
            Outcome::Applied { index } => Ok(index),
            Outcome::NotMember | Outcome::ViewChanged { .. } => Err(CpgError::NotInGroup {
                group: group.to_string(),
            }),
        }
    }

    /// Multicasts `payload` to `group` and returns its position in the agreed order once it is
    /// committed on a majority. Calls made one after another are delivered in that order.
    pub async fn mcast(&self, group: &str, payload: Bytes) -> Result<u64, CpgError> {
        self.mcast_to_view(group, None, payload).await
    }

    /// Like [`Cpg::mcast`], but delivered only if `group` is still in `view` (the index of the
    /// configuration change the sender last saw) when it is applied; otherwise nobody
    /// delivers it and the caller gets [`CpgError::ViewChanged`]. For what must not cross a
    /// membership change (a stream to the members of one view, a role change decided in it).
    pub async fn mcast_in_view(
        &self,
        group: &str,
        view: u64,
        payload: Bytes,
    ) -> Result<u64, CpgError> {
        self.mcast_to_view(group, Some(view), payload).await
    }

    async fn mcast_to_view(
        &self,
        group: &str,
        view: Option<u64>,
        payload: Bytes,
    ) -> Result<u64, CpgError> {
        let max_bytes = self.inner.config.max_payload_bytes;
        if payload.len() > max_bytes {
            return Err(CpgError::PayloadTooLarge {
                len_bytes: payload.len(),
                max_bytes,
            });
        }
        let cmd = Command::Mcast {
            group: group.to_string(),
            sender: self.inner.id,
            view,
            payload: payload.to_vec(),
        };
        match self.propose(cmd).await? {
            Outcome::Applied { index } => Ok(index),
            Outcome::NotMember => Err(CpgError::NotInGroup {
                group: group.to_string(),
            }),
            Outcome::ViewChanged { view } => Err(CpgError::ViewChanged {
                group: group.to_string(),
                view,
            }),
        }
    }

    /// Leaves the cluster for good: the leader removes this member from the voters, so the
    /// others no longer count it in their majority (a stopped voter would: five voters of
    /// which two stopped survive no further failure). The others see it fail at once; a
    /// follower then stops as evicted, a leader leads on until the process stops (openraft
    /// 0.9 steps it down; the others elect a new one). Returns once the removal is
    /// committed; a restart on the same data afterwards is admitted again as a new voter.
    /// The leader refuses to remove the last voter, and any voter while no majority of the
    /// ones that stay was heard from lately (both end in [`CpgError::NotCommitted`], the
    /// member still a voter).
    pub async fn retire(&self) -> Result<(), CpgError> {
        let timeout = write_timeout(&self.inner.config);
        let deadline = Instant::now() + timeout;
        let retry = Duration::from_millis(self.inner.config.heartbeat_ms);
        let mut hint: Option<String> = None;
        loop {
            if let Some(reason) = self.stop_reason() {
                // Removed by an answer that did not reach it (a timed-out call), then told
                // by the removal itself.
                return if self.voter_ids().contains(&self.inner.id) {
                    Err(CpgError::Stopped(reason))
                } else {
                    Ok(())
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CpgError::NotCommitted(
                    "no leader removed this voter in time".into(),
                ));
            }
            let Some(addr) = hint.take().or_else(|| self.leader_addr()) else {
                tokio::time::sleep(retry).await;
                continue;
            };
            let env = Envelope {
                to: None,
                req: Request::Retire { id: self.inner.id },
            };
            match self.inner.transport.call(&addr, env, left).await {
                Ok(Response::Retired) => return Ok(()),
                Ok(Response::NotLeader { leader }) => {
                    hint = leader.filter(|l| *l != addr);
                    tokio::time::sleep(retry).await;
                }
                // A membership change under way (an admission, the monitor's removal), or a
                // leader that went away: asked again until the deadline.
                Ok(_) | Err(_) => tokio::time::sleep(retry).await,
            }
        }
    }

    /// The cluster address of the leader as this member knows it.
    fn leader_addr(&self) -> Option<String> {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        let leader = m.current_leader?;
        m.membership_config
            .membership()
            .get_node(&leader)
            .map(|n| n.addr.clone())
    }

    /// Stops the member cleanly; the others see it fail after their failure timeout.
    pub async fn shutdown(&self) {
        self.set_stop(StopReason::Shutdown);
        self.inner.retired.store(true, Ordering::Release);
        let tasks: Vec<_> = self.inner.tasks.lock().drain(..).collect();
        for t in tasks {
            t.abort();
        }
        // An error here means it had already stopped.
        let _ = self.inner.raft.shutdown().await;
    }

    pub(super) fn set_stop(&self, reason: StopReason) {
        let changed = self.inner.stop.send_if_modified(|s| {
            if s.is_some() {
                return false;
            }
            *s = Some(reason);
            true
        });
        if changed {
            tracing::warn!(member = self.inner.id, %reason, "CPG member stopping");
        }
    }

    fn check_running(&self) -> Result<(), CpgError> {
        match self.stop_reason() {
            Some(r) => Err(CpgError::Stopped(r)),
            None => Ok(()),
        }
    }

    /// Commits `cmd` through the leader, wherever it is.
    async fn propose(&self, cmd: Command) -> Result<Outcome, CpgError> {
        let timeout = write_timeout(&self.inner.config);
        let deadline = Instant::now() + timeout;
        let retry = Duration::from_millis(self.inner.config.heartbeat_ms);
        loop {
            self.check_running()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CpgError::NotCommitted(
                    "no leader accepted it in time".into(),
                ));
            }
            let local = tokio::time::timeout(left, self.inner.raft.client_write(cmd.clone())).await;
            let leader_addr = match local {
                Ok(Ok(r)) => return Ok(r.data),
                Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                    f.leader_node.map(|n| n.addr)
                }
                Ok(Err(e)) => return Err(CpgError::Indeterminate(e.to_string())),
                Err(_) => return Err(CpgError::Indeterminate("commit timed out".into())),
            };
            let Some(addr) = leader_addr else {
                tokio::time::sleep(retry).await;
                continue;
            };
            let env = Envelope {
                to: None,
                req: Request::Write(cmd.clone()),
            };
            match self.inner.transport.call(&addr, env, left).await {
                Ok(Response::Written(o)) => return Ok(o),
                Ok(Response::NotLeader { .. }) => tokio::time::sleep(retry).await,
                Ok(other) => {
                    return Err(CpgError::Indeterminate(format!(
                        "leader answered {other:?}"
                    )));
                }
                Err(e) => return Err(CpgError::Indeterminate(e.to_string())),
            }
        }
    }

    /// Starts this process's incarnation in the background: a restarted member first makes
    /// sure the leader knows it (at its current address, as a voter), then commits its
    /// [`Command::Start`], retrying until this member has applied it or stops.
    fn spawn_start(&self) {
        let weak = Arc::downgrade(&self.inner);
        let task = tokio::spawn(async move {
            let mut admitted = false;
            // The index of the start committed for this process, until this member applies it.
            let mut committed: Option<u64> = None;
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let cpg = Cpg { inner };
                if cpg.stop_reason().is_some() || cpg.started().is_some() {
                    return;
                }
                let retry = Duration::from_millis(cpg.inner.config.join_retry_ms);
                if let Some(index) = committed {
                    // The process starts when this member applies that entry, unless the
                    // leader sends it a snapshot past it instead (seed 1590 of the skew sweep:
                    // a new member at 598 installed a snapshot at 600, its start being 599),
                    // which would leave the process unstarted for good: then it proposes its
                    // start again. The applied index is read before `started`, so that an
                    // apply in between is not taken for a skip.
                    let applied = cpg.applied_index();
                    if cpg.started().is_some() {
                        return;
                    }
                    if applied < index {
                        drop(cpg);
                        tokio::time::sleep(retry).await;
                        continue;
                    }
                }
                if cpg.inner.restarted && !admitted {
                    admitted = cpg.rejoin_once().await;
                    if !admitted {
                        drop(cpg);
                        tokio::time::sleep(retry).await;
                        continue;
                    }
                }
                let cmd = Command::Start {
                    member: cpg.inner.id,
                    incarnation: cpg.inner.incarnation,
                    reset: cpg.inner.reset,
                };
                if let Ok(Outcome::Applied { index }) = cpg.propose(cmd).await {
                    // Committed: not proposed again unless this member skips it, so that the
                    // incarnation starts at one index.
                    committed = Some(index);
                    continue;
                }
                drop(cpg);
                tokio::time::sleep(retry).await;
            }
        });
        self.inner.tasks.lock().push(task);
    }

    /// One round of asking the members of the last known configuration (and the seeds) to
    /// admit this restarted member; true once one that leads said it is a voter here.
    async fn rejoin_once(&self) -> bool {
        let inner = &self.inner;
        let mut targets: Vec<String> = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            m.membership_config
                .membership()
                .nodes()
                .filter(|(id, _)| **id != inner.id)
                .map(|(_, n)| n.addr.clone())
                .collect()
        };
        targets.extend(inner.config.seeds.iter().cloned());
        let timeout = Duration::from_millis(inner.config.rpc_timeout_ms.saturating_mul(4));
        let mut hint: Option<String> = None;
        for addr in targets {
            let addr = hint.take().unwrap_or(addr);
            let env = Envelope {
                to: None,
                req: Request::Join {
                    id: inner.id,
                    addr: inner.addr.clone(),
                },
            };
            match inner.transport.call(&addr, env, timeout).await {
                Ok(Response::Joined) => return true,
                Ok(Response::NotLeader { leader: Some(l) }) => hint = Some(l),
                Ok(_) | Err(_) => {}
            }
        }
        false
    }

    /// Founds the cluster (no seeds) or asks the seeds until one admits this member.
    pub(crate) async fn admit(&self) -> Result<(), CpgError> {
        let inner = &self.inner;
        if inner.config.seeds.is_empty() {
            let node = BasicNode {
                addr: inner.addr.clone(),
            };
            inner
                .raft
                .initialize(BTreeMap::from([(inner.id, node)]))
                .await
                .map_err(|e| CpgError::Config(format!("cannot found a cluster: {e}")))?;
            tracing::info!(member = inner.id, addr = %inner.addr, "founded a new CPG cluster");
            return Ok(());
        }
        let timeout_ms = inner.config.join_timeout_ms;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        let retry = Duration::from_millis(inner.config.join_retry_ms);
        let mut next_seed = 0usize;
        let mut hint: Option<String> = None;
        while Instant::now() < deadline {
            let addr = match hint.take() {
                Some(a) => a,
                None => {
                    let seed = inner.config.seeds[next_seed % inner.config.seeds.len()].clone();
                    next_seed = next_seed.wrapping_add(1);
                    seed
                }
            };
            let env = Envelope {
                to: None,
                req: Request::Join {
                    id: inner.id,
                    addr: inner.addr.clone(),
                },
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match inner
                .transport
                .call(&addr, env, left.min(write_timeout(&inner.config)))
                .await
            {
                Ok(Response::Joined) => {
                    tracing::info!(member = inner.id, via = %addr, "admitted to the CPG cluster");
                    return Ok(());
                }
                Ok(Response::NotLeader { leader: Some(l) }) if l != addr => {
                    hint = Some(l);
                    continue;
                }
                Ok(_) | Err(_) => tokio::time::sleep(retry).await,
            }
        }
        Err(CpgError::JoinTimeout { timeout_ms })
    }
}

/// The file holding a member's stable id inside its data directory.
const MEMBER_ID_FILE: &str = "member-id";

/// Opens the member's consensus state in `dir`: its id (made on first use) and its disk.
/// An id file without state is a member that never got admitted (it may still found or join
/// afresh); state without an id file is damage, refused rather than guessed at.
fn open_data_dir(dir: &Path) -> Result<(MemberId, Arc<dyn Disk>), CpgError> {
    let err = |reason: String| CpgError::Storage {
        dir: dir.display().to_string(),
        reason,
    };
    let disk = DirDisk::open(dir).map_err(|e| err(e.to_string()))?;
    let path = dir.join(MEMBER_ID_FILE);
    let id = match std::fs::read_to_string(&path) {
        Ok(text) => text
            .trim()
            .parse::<MemberId>()
            .map_err(|e| err(format!("{} is damaged: {e}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let state = disk.load().map_err(|e| err(e.to_string()))?;
            if !state.is_empty() {
                return Err(err(format!(
                    "consensus state without {}: restore the file or empty the directory",
                    path.display()
                )));
            }
            let id = CpgRng.next_u64().max(1);
            write_atomically(dir, MEMBER_ID_FILE, format!("{id}\n").as_bytes())
                .map_err(|e| err(e.to_string()))?;
            id
        }
        Err(e) => return Err(err(e.to_string())),
    };
    Ok((id, Arc::new(disk)))
}
