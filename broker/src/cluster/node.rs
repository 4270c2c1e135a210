//! A broker as a cluster member: the handle the rest of the broker holds ([`Cluster`]). It
//! starts CPG, joins the cluster group, starts the applier (`applier.rs`) that applies
//! delivered events in agreed order, submits its own clients' requests and answers them, and
//! answers what the map says (roles, sessions, members, readiness).

use super::applier::{Applier, read_checkpoint};
use super::host::ClusterHost;
use super::map::ClusterMap;
use super::membership::{MemberInfo, MemberState, Membership};
use super::message::ClusterMsg;
use super::rebalance::{PlannedMove, Rebalance};
use super::roles::{QueueRoles, Roles};
use crate::core::AmqpError;
use crate::core::{OpReply, WiringOp};
use crate::cpg::{Cpg, CpgConfig, CpgError, MemberId};
use crate::session::directory::{SessionDirectory, SessionRecord};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

/// The CPG group every member of a cluster joins.
pub const GROUP: &str = "ringmq";

/// How long a client's wiring change may wait for its commit before it is answered with an
/// error (no quorum, a partition): the client learns, instead of hanging.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a broker needs to join a cluster.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// Cluster port address.
    pub listen: SocketAddr,
    /// Address other members dial (`host:port`); `None` = the bound address.
    pub advertise: Option<String>,
    /// Members to ask for admission; empty founds a new cluster.
    pub seeds: Vec<String>,
    /// Shared cluster secret.
    pub secret: Vec<u8>,
    /// How long a silent member stays in the cluster (CPG `failure_timeout_ms`).
    pub failure_timeout_ms: u64,
    /// This member's addresses and identity, announced to the others.
    pub info: MemberInfo,
    /// How long to wait for admission and the cluster map before giving up.
    pub join_timeout: Duration,
    /// When no seed admits this member within `join_timeout`, found the cluster instead of
    /// giving up: the configured founder of a cluster whose seeds are a DNS name that every
    /// member shares (a Kubernetes headless Service), where the first pod finds nobody. Only
    /// ever on an empty cluster directory: a member that belonged to a cluster never founds.
    pub found_if_no_seed_answers: bool,
    /// Where this member keeps its cluster state (`<data-dir>/cluster`): its consensus state
    /// (`consensus/`) and its map checkpoint (`map.json`). With them a restart is the same
    /// member, resuming where it stopped.
    pub dir: PathBuf,
}

/// How often [`Cluster::ready_within_grace`] looks again.
const READY_POLL: Duration = Duration::from_millis(10);

/// [`Cluster::serving_grace`] of a member running with `config`.
fn serving_grace(config: &CpgConfig) -> Duration {
    Duration::from_millis(
        config
            .failure_timeout_ms
            .saturating_sub(config.lease_ms + 2 * config.heartbeat_ms),
    )
}

/// Why a broker could not become a cluster member.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The CPG layer did not start or admit us.
    #[error("cluster layer: {0}")]
    Cpg(#[from] CpgError),
    /// A new member was admitted but did not become ready (get the map, catch up) in time.
    #[error("not ready within {waited:?}: {reason}")]
    NotReady {
        /// How long it waited.
        waited: Duration,
        /// Why it was not ready then.
        reason: String,
    },
    /// The cluster directory cannot be read.
    #[error("cluster state in {dir}: {reason}")]
    State {
        /// The directory.
        dir: String,
        /// What is wrong.
        reason: String,
    },
}

/// The answer to a client's wiring change: the reply, and the journal sequence number that
/// must be durable before it is sent (a durable change was saved), or the AMQP error.
pub type OpOutcome = Result<(OpReply, Option<u64>), AmqpError>;

/// A running cluster member.
pub struct Cluster {
    pub(super) cpg: Cpg,
    pub(super) me: MemberId,
    pub(super) node_id: String,
    pending: Mutex<HashMap<u64, oneshot::Sender<OpOutcome>>>,
    pub(super) next_request: AtomicU64,
    pub(super) membership: RwLock<Membership>,
    /// Every clustered queue's roles, as of the newest event applied.
    pub(super) roles: RwLock<Roles>,
    /// Every resumable session, as of the newest cluster event applied.
    pub(super) sessions: RwLock<SessionDirectory>,
    /// The newest rebalance, as of the newest cluster event applied.
    pub(super) rebalance: RwLock<Option<Rebalance>>,
    pub(super) progress: Mutex<Progress>,
    link_password: String,
    /// How long a lapse of readiness is ridden out before clients are turned away
    /// ([`Cluster::serving_grace`]).
    serving_grace: Duration,
    /// [`Cluster::election_grace`].
    election_grace: Duration,
    /// Agreed index of the cluster event being applied (set before it changes anything) and
    /// of the last one applied in full (set after): equal while no event is being applied,
    /// so a reader can tell a consistent view from one torn by an event
    /// ([`Cluster::read_consistent`]).
    pub(super) event_begun: AtomicU64,
    pub(super) event_ended: AtomicU64,
    /// This member is leaving the cluster for good ([`Cluster::retire_if_drained`]): its
    /// consensus stopping is then the end of the process's shutdown, not a reason to exit
    /// and restart.
    pub(super) retiring: AtomicBool,
    /// How many CPG events the applier has applied ([`crate::cpg::CpgEvents::received`]):
    /// what [`Cluster::catch_up`] compares a read index's [`crate::cpg::SyncPoint`] with.
    pub(super) events_applied: tokio::sync::watch::Sender<u64>,
}

/// What [`Cluster::retire_if_drained`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retirement {
    /// The member is no longer a voter: the others' majority no longer counts it.
    Retired,
    /// It is not drained: a restart, so it stays a voter and comes back as the same one.
    NotDrained,
    /// Drained, but the map still gives it roles (the drain has not finished): leaving
    /// for good would be a failure of those queues' copies, so it stays a voter.
    StillHolds(super::Held),
    /// It is the cluster's last voter.
    LastVoter,
}

/// How far this member is on its way to serving: its incarnation started, it holds the map,
/// and it has applied everything committed when it asked (a read index).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Progress {
    pub(super) live: bool,
    pub(super) synced: bool,
    /// Its own hello has been applied (see [`ClusterMap::is_announced`]).
    pub(super) announced: bool,
    pub(super) caught_up: bool,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("me", &self.me)
            .field("node_id", &self.node_id)
            .field("addr", &self.cpg.addr())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Starts CPG and returns: at once for a member restarting on its cluster directory (which
    /// then waits, in the background, for a majority of its last configuration, serving
    /// nobody until [`Cluster::not_ready_reason`] is `None`), and for a new member once it is
    /// admitted and ready (or an error after `join_timeout`).
    pub async fn start(
        host: impl ClusterHost,
        settings: ClusterSettings,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let checkpoint = read_checkpoint(&settings.dir)?;
        let config = CpgConfig {
            listen: settings.listen,
            advertise: settings.advertise.clone(),
            seeds: settings.seeds.clone(),
            secret: settings.secret.clone(),
            failure_timeout_ms: settings.failure_timeout_ms,
            join_timeout_ms: settings.join_timeout.as_millis() as u64,
            data_dir: Some(settings.dir.join("consensus")),
            resume_after: checkpoint.as_ref().map_or(0, |c| c.through),
            ..CpgConfig::default()
        };
        let grace = serving_grace(&config);
        let mut founding = config.seeds.is_empty();
        let (cpg, events) = match Cpg::start(config.clone()).await {
            Err(CpgError::JoinTimeout { timeout_ms })
                if settings.found_if_no_seed_answers && !config.seeds.is_empty() =>
            {
                founding = true;
                tracing::warn!(
                    timeout_ms,
                    "no seed admitted this member: founding the cluster (this member is the configured founder and its cluster directory is empty)"
                );
                Cpg::start(CpgConfig {
                    seeds: Vec::new(),
                    ..config
                })
                .await?
            }
            started => started?,
        };
        // Founded a new cluster on an empty cluster directory (a restart never founds).
        let founded = founding && !cpg.is_restart();
        let map = match checkpoint.filter(|_| cpg.is_restart()) {
            Some(c) => ClusterMap::resume(cpg.id(), c),
            None => ClusterMap::new(cpg.id(), founded),
        };
        let cluster = Arc::new(Cluster {
            me: cpg.id(),
            cpg,
            node_id: settings.info.node_id.clone(),
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            membership: RwLock::new(Membership::default()),
            roles: RwLock::new(Roles::default()),
            sessions: RwLock::new(SessionDirectory::default()),
            rebalance: RwLock::new(None),
            progress: Mutex::new(Progress::default()),
            link_password: crate::proxy::link::link_password(&settings.secret),
            serving_grace: grace,
            election_grace: Duration::from_millis(config.failure_timeout_ms),
            event_begun: AtomicU64::new(0),
            event_ended: AtomicU64::new(0),
            retiring: AtomicBool::new(false),
            events_applied: tokio::sync::watch::Sender::new(0),
        });
        let applier = Applier::new(map, host, cluster.clone(), settings.info, settings.dir);
        tokio::spawn(applier.run(events));
        tracing::info!(
            member = cluster.me,
            addr = cluster.cpg.addr(),
            restart = cluster.cpg.is_restart(),
            "cluster member started"
        );
        if !cluster.cpg.is_restart() {
            // A new member: as before, it starts serving only once it holds the map, so a
            // script that connects when the listeners are announced finds it ready.
            cluster.wait_ready(settings.join_timeout).await?;
        }
        Ok(cluster)
    }

    /// Waits until this member is ready to serve (see [`Cluster::not_ready_reason`]).
    async fn wait_ready(&self, limit: Duration) -> Result<(), ClusterError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let Some(reason) = self.not_ready_reason() else {
                return Ok(());
            };
            if tokio::time::Instant::now() >= deadline {
                self.cpg.shutdown().await;
                return Err(ClusterError::NotReady {
                    waited: limit,
                    reason,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until this member has applied every cluster change committed before the call
    /// (a read index, [`Cpg::sync`]): whether it has, within the cluster's write timeout and
    /// then [`crate::proxy::catch_up::CATCH_UP_LIMIT`] (at once false without a quorum). A
    /// member about to answer 404 for a queue or exchange asks this first: a client that
    /// another member answered declare-ok may name it here before this member applied the
    /// same committed declare, and one broker would have found it.
    pub async fn catch_up(&self) -> bool {
        if !self.cpg.has_quorum_now() {
            return false;
        }
        let Ok(point) = self.cpg.sync().await else {
            return false;
        };
        let mut applied = self.events_applied.subscribe();
        tokio::time::timeout(
            crate::proxy::catch_up::CATCH_UP_LIMIT,
            applied.wait_for(|n| *n >= point.events),
        )
        .await
        .is_ok_and(|r| r.is_ok())
    }

    /// Why this member must not serve clients now, or `None` when it may: it must hold the
    /// majority's lease at this instant (checked against the clock, not cached), have started
    /// its incarnation, hold the cluster map, have applied its own hello (a member restarted
    /// in place hands its primaries over with it), and have caught up with what was
    /// committed when it started.
    pub fn not_ready_reason(&self) -> Option<String> {
        if !self.cpg.has_quorum_now() {
            let (reachable, voters) = self.cpg.voters_reachable();
            let need = voters / 2 + 1;
            return Some(format!(
                "waiting for {need} of {voters} members (a majority of its last configuration); {reachable} reachable"
            ));
        }
        let p = *self.progress.lock();
        if !p.live {
            Some("starting: announcing this member to the cluster".into())
        } else if !p.synced {
            Some("waiting for the cluster map from a member that holds it".into())
        } else if !p.announced {
            Some("waiting for this member's own announcement to the cluster to be applied".into())
        } else if !p.caught_up {
            Some("catching up with the cluster's newest changes".into())
        } else if self.membership.read().is_newcomer(&self.node_id) {
            Some("new to the ring: waiting for its share of the queues to be handed over".into())
        } else {
            None
        }
    }

    /// How long this member rides out a lapse of its readiness (the majority's lease missing
    /// a renewal under a stall of the machine, or lapsing while the others elect a new
    /// consensus leader after the old one's loss) before it closes its clients and refuses
    /// wiring changes: what the failure timeout leaves after the lease and two heartbeats
    /// (one for the readiness check's period), so the clients are gone before the others may
    /// declare this member failed and hand its queues over. Meanwhile nothing is confirmed (the confirm gate asks for the
    /// lease) and wiring changes wait, so a lapse shorter than this costs latency, not
    /// connections.
    pub fn serving_grace(&self) -> Duration {
        self.serving_grace
    }

    /// Whether this member voted for another member's candidacy that has not won yet: its
    /// lapse is an election after the leader's loss, in contact with the others
    /// ([`crate::cpg::Cpg::voted_for_a_candidate`]).
    pub fn voted_for_a_candidate(&self) -> bool {
        self.cpg.voted_for_a_candidate()
    }

    /// The longest a member that voted for a candidate rides out its lapse: a failure
    /// timeout (see `broker/majority.rs`).
    pub fn election_grace(&self) -> Duration {
        self.election_grace
    }

    /// When this member's lease ran out, if it held one and it has: the start of a lapse.
    pub fn lease_ended_at(&self) -> Option<tokio::time::Instant> {
        self.cpg
            .lease_deadline()
            .filter(|d| *d <= tokio::time::Instant::now())
    }

    /// Notifies changes of the majority's lease, within a heartbeat (see [`Cpg::quorum`]);
    /// decide with [`Cluster::has_quorum`].
    pub fn quorum(&self) -> tokio::sync::watch::Receiver<bool> {
        self.cpg.quorum()
    }

    /// Waits up to [`Cluster::serving_grace`] for this member to be ready; the reason it
    /// is not when the grace runs out.
    pub async fn ready_within_grace(&self) -> Option<String> {
        let deadline = tokio::time::Instant::now() + self.serving_grace;
        loop {
            let reason = self.not_ready_reason()?;
            if tokio::time::Instant::now() >= deadline {
                return Some(reason);
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Address of the cluster port (useful with port 0).
    pub fn addr(&self) -> &str {
        self.cpg.addr()
    }

    /// Whether every announced member reads replicated deliveries that name their session
    /// ([`Membership::every_member_holds_for_sessions`]): until then a primary leaves the
    /// sessions out of its replication stream.
    pub fn every_member_holds_for_sessions(&self) -> bool {
        self.membership.read().every_member_holds_for_sessions()
    }

    /// This member's node id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The password of the links between members ([`crate::proxy::link`]).
    pub fn link_password(&self) -> &str {
        &self.link_password
    }

    /// The members in ring order.
    pub fn members(&self) -> Vec<MemberState> {
        self.membership.read().members().to_vec()
    }

    /// The roles of queue `queue` in `vhost` — primary, backups, in-sync set — as of the
    /// newest cluster event applied here; `None` for a queue that has none (not clustered,
    /// exclusive, or no such queue).
    pub fn queue_roles(&self, vhost: &str, queue: &str) -> Option<QueueRoles> {
        self.roles.read().get(vhost, queue).cloned()
    }

    /// Runs `read` (which looks at state the cluster events change: a queue's roles or
    /// `home`, the ring) and returns what it saw with the configuration it belongs to
    /// ([`Membership::configuration`]) — or `None` if a cluster event was applied while it
    /// read, three times over. A seqlock: an answer that names a primary and a configuration
    /// is then one this member held at one instant, never half of one event and half of
    /// the next (what the fault suite's two-primaries checker needs to be exact).
    pub fn read_consistent<T>(&self, mut read: impl FnMut() -> T) -> Option<(T, u64)> {
        for _ in 0..3 {
            let ended = self.event_ended.load(Ordering::SeqCst);
            let seen = read();
            let configuration = self.membership.read().configuration();
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.event_begun.load(Ordering::SeqCst) == ended {
                return Some((seen, configuration));
            }
            std::thread::yield_now();
        }
        None
    }

    /// Whether this member holds the cluster's current map: its incarnation started, it has
    /// the map (founded it or installed a snapshot) and caught up with what was committed
    /// when it started. Before that, what its vhosts say of a queue's home is a leftover of
    /// an earlier life (a restart replaying its log, a member that was evicted and rejoins),
    /// not a role it holds.
    pub fn holds_current_map(&self) -> bool {
        let p = *self.progress.lock();
        p.live && p.synced && p.caught_up
    }

    /// Whether this process's incarnation has started: the events it applies now are new,
    /// not a restart's replay of the agreed log.
    pub fn is_live(&self) -> bool {
        self.progress.lock().live
    }

    /// Whether member `node` is being drained (`cluster drain`), as of the newest event
    /// applied here.
    pub fn is_draining(&self, node: &str) -> bool {
        self.membership.read().draining().contains(node)
    }

    /// Node id of an announced member of a version without ring layouts, if there is one
    /// (a layout set now would make it leave the cluster).
    pub fn predating_layouts(&self) -> Option<String> {
        self.membership
            .read()
            .predating_layouts()
            .map(str::to_owned)
    }

    /// The ring's layout in force, and the agreed index of the op that last set it (0: never),
    /// as of the newest event applied here.
    pub fn layout(&self) -> (super::layout::RingLayout, u64) {
        let m = self.membership.read();
        (m.layout().clone(), m.layout_changed_at())
    }

    /// What each member (by node id) holds of the cluster's queues, as of the newest event
    /// applied here: the same answer on every member that applied it.
    pub fn held(&self) -> BTreeMap<String, super::Held> {
        self.roles.read().held()
    }

    /// Session `id`'s record — which member holds it, for whom, whether attached — as of
    /// the newest cluster event applied here.
    pub fn session(&self, id: &str) -> Option<SessionRecord> {
        self.sessions.read().get(id).cloned()
    }

    /// Every session of the cluster, as of the newest cluster event applied here.
    pub fn sessions(&self) -> SessionDirectory {
        self.sessions.read().clone()
    }

    /// The sessions that wait without a connection, and the member that times each out
    /// ([`SessionDirectory::keeper`]) given the ring now: read under the lock, so a tick
    /// that finds none copies nothing.
    pub fn detached_sessions(&self) -> Vec<(String, SessionRecord, Option<String>)> {
        let ring = self.ring();
        let sessions = self.sessions.read();
        sessions
            .iter()
            .filter(|(_, r)| !r.attached)
            .map(|(id, r)| {
                let keeper = sessions.keeper(id, &ring).map(str::to_owned);
                (id.to_owned(), r.clone(), keeper)
            })
            .collect()
    }

    /// The newest rebalance (`cluster rebalance --apply`), under way or finished, as of
    /// the newest cluster event applied here.
    pub fn rebalance(&self) -> Option<Rebalance> {
        self.rebalance.read().clone()
    }

    /// The moves a rebalance started now would plan (`cluster rebalance` without
    /// `--apply`): the same plan every member would make from the map it holds now.
    pub fn rebalance_plan(&self) -> Vec<PlannedMove> {
        let roles = self.roles.read();
        let membership = self.membership.read();
        super::rebalance::plan(&roles, &membership, None)
    }

    /// The backup moves a rebalance would plan if the primaries stayed where they are now
    /// (a rebalance plans them once its primary moves are done).
    pub fn rebalance_backup_plan(&self) -> Vec<PlannedMove> {
        let roles = self.roles.read();
        let membership = self.membership.read();
        let ring = membership.ring();
        super::rebalance::backup_plan(&roles, &ring, membership.draining())
    }

    /// Node ids of the members that announced themselves, in ring order.
    pub fn ring(&self) -> Vec<String> {
        self.membership.read().ring()
    }

    /// AMQP addresses of the live members (`known-hosts`).
    pub fn known_hosts(&self) -> Vec<String> {
        self.membership.read().known_hosts()
    }

    /// Leaves the cluster for good if this member was drained and holds nothing — what a
    /// drained member's stop means (a scale-down, a node retired by hand): the others stop
    /// counting it as a voter, so the cluster keeps its tolerance of further failures (a
    /// stopped voter of five leaves room for one more failure, not two; two of five, none).
    /// A member that is not drained stays a voter: its stop is a restart. Asked once, on the
    /// way out; a restart on the same data is admitted again (as a new voter).
    pub async fn retire_if_drained(&self) -> Result<Retirement, CpgError> {
        if !self.is_draining(&self.node_id) {
            return Ok(Retirement::NotDrained);
        }
        let held = self.held().remove(&self.node_id).unwrap_or_default();
        if held != super::Held::default() {
            return Ok(Retirement::StillHolds(held));
        }
        if self.voters() <= 1 {
            return Ok(Retirement::LastVoter);
        }
        self.retiring.store(true, Ordering::SeqCst);
        self.cpg.retire().await?;
        Ok(Retirement::Retired)
    }

    /// Voters of the consensus group, dead ones included until they are removed.
    pub fn voters(&self) -> usize {
        self.cpg.voter_count()
    }

    /// Node id of the consensus leader as this member knows it: `None` during an election,
    /// while this member does not hold the majority's lease, or while the leader is not (yet)
    /// a member that announced itself in the cluster group.
    /// What an operator looks at first when the cluster stalls.
    pub fn leader(&self) -> Option<String> {
        // Without the majority's lease, what this member last heard of a leader may be long
        // stale (restarted alone, or just resumed from a pause).
        if !self.cpg.has_quorum_now() {
            return None;
        }
        let leader = self.cpg.leader()?;
        self.membership
            .read()
            .members()
            .iter()
            .find(|m| m.id == leader)
            .and_then(|m| m.info.as_ref())
            .map(|info| info.node_id.clone())
    }

    /// Whether this member holds the majority's lease at this instant (see
    /// [`Cpg::has_quorum_now`]): after a pause of this process it is false from the first
    /// question on.
    pub fn has_quorum(&self) -> bool {
        self.cpg.has_quorum_now()
    }

    /// Multicasts a wiring change for `vhost`; the receiver yields the outcome once this
    /// member applied it (or an error if it could not be committed in time).
    pub fn submit(self: &Arc<Self>, vhost: &str, op: WiringOp) -> oneshot::Receiver<OpOutcome> {
        let (tx, rx) = oneshot::channel();
        let request = self.next_request.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().insert(request, tx);
        let msg = ClusterMsg::Op {
            origin: self.me,
            request,
            vhost: vhost.to_owned(),
            op,
        };
        let cluster = self.clone();
        tokio::spawn(async move {
            if let Some(reason) = cluster.ready_within_grace().await {
                // Refused rather than after a commit timeout: this member is not part of the
                // majority's cluster now, and has not been for a whole grace.
                if let Some(tx) = cluster.pending.lock().remove(&request) {
                    let _ = tx.send(Err(AmqpError::new(
                        crate::amqp::codes::RESOURCE_ERROR,
                        format!("this cluster member cannot change the wiring now: {reason}"),
                    )));
                }
                return;
            }
            let sent = tokio::time::timeout(COMMIT_TIMEOUT, cluster.mcast(&msg)).await;
            let error = match sent {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("not committed within {COMMIT_TIMEOUT:?} (no quorum?)"),
            };
            tracing::warn!(request, %error, "wiring change not committed");
            if let Some(tx) = cluster.pending.lock().remove(&request) {
                let _ = tx.send(Err(AmqpError::new(
                    crate::amqp::codes::RESOURCE_ERROR,
                    format!("the cluster could not commit this change: {error}"),
                )));
            }
        });
        rx
    }

    pub(super) async fn mcast(&self, msg: &ClusterMsg) -> Result<(), CpgError> {
        self.cpg
            .mcast(GROUP, Bytes::from(msg.encode()))
            .await
            .map(|_| ())
    }

    pub(super) fn answer(&self, request: u64, outcome: OpOutcome) {
        if let Some(tx) = self.pending.lock().remove(&request) {
            let _ = tx.send(outcome);
        }
    }
}
