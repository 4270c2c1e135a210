//! A running CPG member: the [`Cpg`] handle the application holds, the [`CpgEvents`] stream it
//! reads, and the background duties (admission, lease renewal, failure detection).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
use super::error::{CpgError, StopReason};
use super::event::CpgEvent;
use super::lease::Lease;
use super::log_store::LogStore;
use super::network::NetworkFactory;
use super::runtime::CpgRng;
use super::service::Service;
use super::state_machine::{EventSink, StateMachine};
use super::tcp::{self, TcpTransport};
use super::transport::Transport;
use super::types::{Command, CpgTypes, MemberId, Outcome};
use super::wire::{Envelope, Request, Response};

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
}

impl CpgEvents {
    /// The next event; `None` once the member has stopped and every event queued before that
    /// has been returned ([`Cpg::stop_reason`] then tells why).
    pub async fn recv(&mut self) -> Option<CpgEvent> {
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
        let id = CpgRng.next_u64();
        let launched = Self::launch(config.clone(), id, addr, transport).await?;
        let server = tokio::spawn(tcp::serve(
            listener,
            Arc::clone(&launched.service),
            secret,
            config.max_frame_bytes,
            Duration::from_millis(config.rpc_timeout_ms.saturating_mul(4)),
        ));
        launched.cpg.inner.tasks.lock().push(server);
        launched.cpg.admit().await?;
        launched.cpg.spawn_monitor();
        Ok((launched.cpg, launched.events))
    }

    /// Builds member `id` at `addr` over `transport`, without serving or joining yet.
    pub(crate) async fn launch(
        config: CpgConfig,
        id: MemberId,
        addr: String,
        transport: Arc<dyn Transport>,
    ) -> Result<Launched, CpgError> {
        config.validate()?;
        let raft_config = raft_config(&config)?;
        let (tx, rx) = mpsc::channel(config.event_queue_len);
        let stop = Arc::new(watch::channel(None).0);
        let failed = Arc::new(Mutex::new(BTreeSet::new()));
        let sm = StateMachine::new(EventSink {
            local: id,
            tx,
            stop: Arc::clone(&stop),
            failed: Arc::clone(&failed),
        });
        let network = NetworkFactory {
            transport: Arc::clone(&transport),
            rpc_timeout: Duration::from_millis(config.rpc_timeout_ms),
            backoff: Duration::from_millis(config.heartbeat_ms),
        };
        let raft = Raft::new(id, raft_config, network, LogStore::default(), sm)
            .await
            .map_err(|e| CpgError::Config(format!("openraft refused to start: {e}")))?;
        let lease = Arc::new(Mutex::new(Lease::new(
            config.lease_ms,
            config.failure_timeout_ms,
            config.heartbeat_ms,
        )));
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
            }),
        };
        Ok(Launched {
            cpg,
            events,
            service,
        })
    }

    /// This member's incarnation id, as other members' events name it.
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

    /// Whether this member currently has quorum; the watch changes within a lease of losing it.
    /// A member without quorum must stop serving what depends on agreement.
    pub fn quorum(&self) -> watch::Receiver<bool> {
        self.inner.quorum_tx.subscribe()
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
        self.inner
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .count()
    }

    /// Why the member stopped, once it has.
    pub fn stop_reason(&self) -> Option<StopReason> {
        *self.inner.stop.borrow()
    }

    /// Whether this member's consensus has stopped too. A member that stopped for a reason of
    /// its own (evicted, overrun, fell behind) delivers nothing more, but its Raft node goes on
    /// voting until the cluster has removed it from the voters: dropping it at once would cost
    /// the others a vote they may need (a 3-member cluster with one partitioned member that
    /// was declared failed and another that crashed). Keep the handle until this is true if the
    /// replacement can start elsewhere; dropping it earlier is a crash to the others.
    pub fn is_retired(&self) -> bool {
        self.inner.retired.load(Ordering::Acquire)
    }

    /// Joins `group`; the member's first event of the group is the configuration change that
    /// lists it in `joined`.
    pub async fn join(&self, group: &str) -> Result<u64, CpgError> {
        let cmd = Command::Join {
            group: group.to_string(),
            member: self.inner.id,
        };
        match self.propose(cmd).await? {
            Outcome::Applied { index } => Ok(index),
            Outcome::NotMember => Err(CpgError::Stopped(StopReason::Evicted)),
        }
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
            Outcome::NotMember => Err(CpgError::NotInGroup {
                group: group.to_string(),
            }),
        }
    }

    /// Multicasts `payload` to `group` and returns its position in the agreed order once it is
    /// committed on a majority. Calls made one after another are delivered in that order.
    pub async fn mcast(&self, group: &str, payload: Bytes) -> Result<u64, CpgError> {
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
            payload: payload.to_vec(),
        };
        match self.propose(cmd).await? {
            Outcome::Applied { index } => Ok(index),
            Outcome::NotMember => Err(CpgError::NotInGroup {
                group: group.to_string(),
            }),
        }
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
