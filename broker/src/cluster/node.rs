//! A broker as a cluster member: starts CPG, joins the cluster group, applies delivered
//! events to the broker's vhosts in agreed order, and answers the requests its own clients
//! made.

use super::map::{Action, Checkpoint, ClusterMap, WiringStore};
use super::membership::{MemberInfo, MemberState, Membership};
use super::message::ClusterMsg;
use super::rebalance::{PlannedMove, Rebalance};
use super::roles::{QueueRoles, Roles};
use crate::core::AmqpError;
use crate::core::{OpReply, RebalanceStep, WiringOp};
use crate::cpg::{Cpg, CpgConfig, CpgError, CpgEvent, CpgEvents, MemberId, SyncPoint};
use crate::session::directory::{SessionDirectory, SessionRecord};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

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

/// The map checkpoint's file in the cluster directory.
const CHECKPOINT_FILE: &str = "map.json";

/// How often, at most, a member saves its map checkpoint.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

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
    cpg: Cpg,
    me: MemberId,
    node_id: String,
    pending: Mutex<HashMap<u64, oneshot::Sender<OpOutcome>>>,
    next_request: AtomicU64,
    membership: RwLock<Membership>,
    /// Every clustered queue's roles, as of the newest event applied.
    roles: RwLock<Roles>,
    /// Every resumable session, as of the newest cluster event applied.
    sessions: RwLock<SessionDirectory>,
    /// The newest rebalance, as of the newest cluster event applied.
    rebalance: RwLock<Option<Rebalance>>,
    progress: Mutex<Progress>,
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
    event_begun: AtomicU64,
    event_ended: AtomicU64,
    /// This member is leaving the cluster for good ([`Cluster::retire_if_drained`]): its
    /// consensus stopping is then the end of the process's shutdown, not a reason to exit
    /// and restart.
    retiring: AtomicBool,
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
struct Progress {
    live: bool,
    synced: bool,
    /// Its own hello has been applied (see [`ClusterMap::is_announced`]).
    announced: bool,
    caught_up: bool,
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
        });
        let applier = Applier {
            map,
            host,
            cluster: cluster.clone(),
            info: settings.info,
            dir: settings.dir,
            saved_through: Arc::new(AtomicU64::new(0)),
            saving: None,
            last_save: Instant::now(),
            sync_point: None,
            share_claimed: false,
        };
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

    async fn mcast(&self, msg: &ClusterMsg) -> Result<(), CpgError> {
        self.cpg
            .mcast(GROUP, Bytes::from(msg.encode()))
            .await
            .map(|_| ())
    }

    fn answer(&self, request: u64, outcome: OpOutcome) {
        if let Some(tx) = self.pending.lock().remove(&request) {
            let _ = tx.send(outcome);
        }
    }
}

/// What the cluster layer needs of the broker it runs in: the wiring store the map changes,
/// plus the two things a member does to the broker outside the map. A trait the cluster
/// owns, so that the cluster layer never reaches up into the broker or the server.
pub trait ClusterHost: WiringStore + Send + 'static {
    /// The live members changed: `hosts` are their AMQP addresses, for the clients of every
    /// vhost (`amq.qpid`); `nodes` their node ids, for the queues they own (a queue whose
    /// primary is not among them refuses publishes).
    fn members_changed(&mut self, hosts: &[String], nodes: &[String]);
    /// Queue `queue` of `vhost` has new roles (`None`: it has none any more): its primary,
    /// where its messages live, is `roles.primary`.
    fn roles_changed(&mut self, vhost: &str, queue: &str, roles: Option<&QueueRoles>);
    /// This process's incarnation started ([`CpgEvent::Started`]): the roles a restart's
    /// replay passed through were not the last, `roles` are. A copy this member holds of a
    /// queue it is neither primary nor backup of may go now, and from here on whenever the
    /// roles say so (never during the replay: a role it lost there it may have got back
    /// later, with a copy caught up outside the agreed log).
    fn started(&mut self, roles: &Roles);
    /// Session `id` was held by this member and no longer is (another member took it over
    /// from the directory, or it ended): what this member kept of it — its channels'
    /// publishing, unacked deliveries, exclusive queues — goes, and a connection still
    /// attached to it here is closed.
    fn session_left(&mut self, id: &str);
    /// Session `id` ended (closed, or timed out), as every member applies it: what the
    /// session owned cluster-wide — its exclusive queues — goes.
    fn session_ended(&mut self, id: &str);
    /// Every cluster event up to agreed index `index` is applied here — whatever it was: a
    /// wiring op, a membership change, a hello, a change of roles or sessions. Another
    /// member's link names the index it had applied when it asks for read-your-writes
    /// (`proxy::catch_up`), and it counts every event too.
    fn event_applied(&mut self, index: u64);
    /// Saves what must survive before the process exits (the journal).
    fn shutdown(&mut self);
    /// The newest journal sequence number handed to the journal, and a watch of the newest
    /// one on disk: a map checkpoint is saved only once every change before it is.
    fn journal(&self) -> (u64, watch::Receiver<u64>);
}

/// Feeds the cluster group's events to the map, in agreed order, carries out what it asks
/// for, and saves its checkpoint.
struct Applier<H> {
    map: ClusterMap,
    host: H,
    cluster: Arc<Cluster>,
    info: MemberInfo,
    dir: PathBuf,
    /// The newest checkpoint saved (and reported to CPG).
    saved_through: Arc<AtomicU64>,
    /// The checkpoint being saved, if any.
    saving: Option<tokio::task::JoinHandle<()>>,
    last_save: Instant,
    /// The read index this member catches up to before it serves.
    sync_point: Option<SyncPoint>,
    /// This process asked for its share of the queues as a member new to the ring.
    share_claimed: bool,
}

impl<H: ClusterHost> Applier<H> {
    async fn run(mut self, mut events: CpgEvents) {
        let (sync_tx, mut sync_rx) = mpsc::channel::<SyncPoint>(1);
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        loop {
            tokio::select! {
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    if let Err(e) = self.on_event(ev, &sync_tx) {
                        tracing::error!(error = %e, "cannot follow the cluster");
                        break;
                    }
                }
                Some(point) = sync_rx.recv() => self.sync_point = Some(point),
                _ = tick.tick() => {}
            }
            self.check_caught_up(&events);
            self.save_checkpoint();
        }
        if self.cluster.retiring.load(Ordering::SeqCst) {
            // Removed from the voters at its own request: the process's shutdown ends it.
            tracing::info!("this broker left the cluster for good");
            return;
        }
        // CPG stopped: evicted (cut off or too slow) or shut down. A member that is not in
        // the cluster must not go on serving a wiring it can no longer keep in step; its
        // supervisor restarts it and it resumes, as the same member, from its cluster state.
        tracing::error!(reason = ?self.cluster.cpg.stop_reason(), "this broker left the cluster; exiting so that it restarts and rejoins");
        self.host.shutdown();
        std::process::exit(3);
    }

    fn on_event(
        &mut self,
        ev: CpgEvent,
        sync_tx: &mpsc::Sender<SyncPoint>,
    ) -> Result<(), super::map::MapError> {
        if ev.group().is_some_and(|g| g != GROUP) {
            return Ok(());
        }
        if let CpgEvent::ConfChg {
            members,
            joined,
            left,
            failed,
            ..
        } = &ev
        {
            let addrs =
                |ms: &[crate::cpg::Member]| ms.iter().map(|m| m.addr.clone()).collect::<Vec<_>>();
            tracing::info!(members = members.len(), joined = ?addrs(joined), left = ?addrs(left), failed = ?addrs(failed), "cluster membership changed");
        }
        let started = matches!(ev, CpgEvent::Started { .. });
        let index = ev.index();
        self.cluster.event_begun.store(index, Ordering::SeqCst);
        let actions = self.map.on_event(ev, &mut self.host)?;
        self.act(actions);
        self.claim_share();
        self.cluster.event_ended.store(index, Ordering::SeqCst);
        if !started && self.map.is_synced() {
            self.host.event_applied(index);
        }
        if started {
            self.cluster.progress.lock().live = true;
            self.host.started(self.map.roles());
            self.spawn_sync(sync_tx.clone());
        }
        Ok(())
    }

    /// Asks for the read index this member must reach before serving (retrying until the
    /// cluster answers).
    fn spawn_sync(&self, tx: mpsc::Sender<SyncPoint>) {
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            loop {
                match cluster.cpg.sync().await {
                    Ok(point) => {
                        let _ = tx.send(point).await;
                        return;
                    }
                    Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::debug!(error = %e, "read index not confirmed yet; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
    }

    fn check_caught_up(&mut self, events: &CpgEvents) {
        let mut p = self.cluster.progress.lock();
        p.synced = self.map.is_synced();
        p.announced = self.map.is_announced();
        if let Some(point) = self.sync_point
            && events.received() >= point.events
            && !p.caught_up
        {
            p.caught_up = true;
            tracing::info!(
                index = point.index,
                "caught up with the cluster: serving clients"
            );
        }
    }

    /// Saves the map checkpoint when it moved on (at most every [`CHECKPOINT_EVERY`], one
    /// save at a time): once the journal holds every change applied before it, write
    /// `map.json`, then tell CPG that events up to it need no replay.
    fn save_checkpoint(&mut self) {
        if self.saving.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let Some(checkpoint) = self.map.checkpoint() else {
            return;
        };
        let saved = self.saved_through.load(Ordering::Acquire);
        if checkpoint.through <= saved || self.last_save.elapsed() < CHECKPOINT_EVERY {
            return;
        }
        self.last_save = Instant::now();
        let (submitted, mut synced) = self.host.journal();
        let dir = self.dir.clone();
        let saved = Arc::clone(&self.saved_through);
        let cpg = self.cluster.cpg.clone();
        self.saving = Some(tokio::spawn(async move {
            while *synced.borrow() < submitted {
                if synced.changed().await.is_err() {
                    return;
                }
            }
            let through = checkpoint.through;
            match tokio::task::spawn_blocking(move || write_checkpoint(&dir, &checkpoint)).await {
                Ok(Ok(())) => {
                    saved.store(through, Ordering::Release);
                    cpg.checkpointed(through);
                }
                Ok(Err(e)) => tracing::error!(error = %e, "cannot save the cluster map checkpoint"),
                Err(_) => {}
            }
        }));
    }

    fn act(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::SendHello => self.announce(),
                Action::SendSnapshot { to, through } => {
                    // Retried like the hello: the joiner waits for nothing else, and no later
                    // event asks again (found by the roles simulation, seed 30087: a lost
                    // snapshot left a new member without the map for good). A copy that
                    // committed twice is harmless: the joiner installs the first.
                    let msg = self.map.snapshot(to, through, &mut self.host);
                    self.multicast_until_committed(msg, "sending the cluster map to a joiner");
                }
                Action::Answer { request, outcome } => self.cluster.answer(request, outcome),
                Action::HostsChanged => {
                    *self.cluster.membership.write() = self.map.membership().clone();
                    self.publish_known_hosts();
                }
                Action::MembershipChanged => {
                    *self.cluster.membership.write() = self.map.membership().clone();
                }
                Action::RebalanceChanged => {
                    *self.cluster.rebalance.write() = self.map.rebalance().cloned();
                }
                Action::Synced => {
                    let roles = self.map.roles().clone();
                    // The broker follows every queue's roles from here: which copy serves,
                    // which replicates to whom.
                    for (vhost, queue, r) in roles.iter() {
                        self.host.roles_changed(vhost, queue, Some(r));
                    }
                    *self.cluster.roles.write() = roles;
                    *self.cluster.sessions.write() = self.map.sessions().clone();
                    *self.cluster.rebalance.write() = self.map.rebalance().cloned();
                    self.cluster.progress.lock().synced = true;
                }
                Action::RolesChanged {
                    vhost,
                    queue,
                    was,
                    now,
                } => {
                    log_roles_change(&vhost, &queue, was.as_ref(), now.as_ref());
                    self.cluster.roles.write().set(&vhost, &queue, now.clone());
                    self.host.roles_changed(&vhost, &queue, now.as_ref());
                }
                Action::SessionChanged { id, was, now } => {
                    tracing::debug!(session = %id, ?was, ?now, "session directory changed");
                    let me = self.cluster.node_id.as_str();
                    let mine =
                        |r: &Option<SessionRecord>| r.as_ref().is_some_and(|r| r.member == me);
                    // Restarted in place, this member held nothing of a session the
                    // directory still named it for; ended here, it let go already.
                    if mine(&was) && !mine(&now) {
                        self.host.session_left(&id);
                    }
                    if was.is_some() && now.is_none() {
                        self.host.session_ended(&id);
                    }
                    self.cluster.sessions.write().set(&id, now);
                }
                Action::Join => self.join(false),
                Action::Rejoin => self.join(true),
            }
        }
    }

    /// Joins the cluster group (after leaving it, for a rejoin), retrying until it is done
    /// or the member stops.
    fn join(&self, leave_first: bool) {
        let cpg = self.cluster.cpg.clone();
        tokio::spawn(async move {
            if leave_first {
                while let Err(e) = cpg.leave(GROUP).await {
                    if matches!(e, CpgError::Stopped(_) | CpgError::NotInGroup { .. }) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            loop {
                match cpg.join(GROUP).await {
                    Ok(_) | Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "joining the cluster group; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
    }

    /// Multicasts this member's hello, retrying until it commits: the member serves only
    /// once its own hello is applied ([`ClusterMap::is_announced`]). (A retry after a timeout
    /// that committed after all makes a second hello, which the others take for a restart in
    /// place: this member's backups catch up again — extra work, never a lost op.)
    fn announce(&self) {
        let msg = ClusterMsg::Hello(self.info.clone());
        self.multicast_until_committed(msg, "announcing this member to the cluster");
    }

    /// A member new to the ring, once it holds the map, asks for its share of the queues
    /// ([`RebalanceStep::Join`]): once per process, and again by the next process if this
    /// one dies before it commits (the map keeps it a newcomer until then). Not through
    /// [`Cluster::submit`], which waits for readiness: a newcomer is not ready until then.
    fn claim_share(&mut self) {
        let me = &self.cluster.node_id;
        if self.share_claimed
            || !self.map.is_synced()
            || !self.map.is_live()
            || !self.map.membership().is_newcomer(me)
        {
            return;
        }
        self.share_claimed = true;
        let msg = ClusterMsg::Op {
            origin: self.cluster.me,
            request: self.cluster.next_request.fetch_add(1, Ordering::Relaxed),
            vhost: String::new(),
            op: WiringOp::Rebalance(RebalanceStep::Join { node: me.clone() }),
        };
        self.multicast_until_committed(msg, "claiming this new member's share of the queues");
    }

    /// Multicasts `msg` again after every failure until it commits or this member stops.
    fn multicast_until_committed(&self, msg: ClusterMsg, what: &'static str) {
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            loop {
                match cluster.mcast(&msg).await {
                    Ok(()) | Err(CpgError::Stopped(_)) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "{what}; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
    }

    fn publish_known_hosts(&mut self) {
        let hosts = self.cluster.known_hosts();
        let nodes: Vec<String> = self
            .cluster
            .members()
            .into_iter()
            .filter_map(|m| m.info.map(|i| i.node_id))
            .collect();
        self.host.members_changed(&hosts, &nodes);
    }
}

/// One line for a change of a queue's roles a person wants to know about: an election, a
/// queue becoming unavailable or available again (at `debug`, backups coming and going).
fn log_roles_change(vhost: &str, queue: &str, was: Option<&QueueRoles>, now: Option<&QueueRoles>) {
    let (Some(was), Some(now)) = (was, now) else {
        return;
    };
    if now.unavailable && !was.unavailable {
        tracing::warn!(
            vhost,
            queue,
            lost_primary = %now.primary,
            waiting_for = ?now.in_sync,
            "queue unavailable: its primary is gone and no backup was in sync; it returns with the lost primary or one of the nodes it waits for"
        );
    } else if now.primary != was.primary {
        tracing::info!(vhost, queue, from = %was.primary, to = %now.primary, backups = ?now.backups, "queue primary elected: an in-sync backup took over");
    } else if was.unavailable && !now.unavailable {
        tracing::info!(vhost, queue, primary = %now.primary, "queue available again: its primary is back");
    } else if now.backups != was.backups || now.in_sync != was.in_sync {
        tracing::debug!(vhost, queue, backups = ?now.backups, in_sync = ?now.in_sync, "queue backups changed");
    }
}

/// Reads the map checkpoint of the cluster directory `dir`, if there is one.
fn read_checkpoint(dir: &Path) -> Result<Option<Checkpoint>, ClusterError> {
    let path = dir.join(CHECKPOINT_FILE);
    let err = |reason: String| ClusterError::State {
        dir: dir.display().to_string(),
        reason,
    };
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| err(format!("{} is damaged: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(err(e.to_string())),
    }
}

/// Replaces the map checkpoint atomically.
fn write_checkpoint(dir: &Path, checkpoint: &Checkpoint) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let bytes = serde_json::to_vec(checkpoint).map_err(std::io::Error::other)?;
    crate::atomic_file::write_atomically(dir, CHECKPOINT_FILE, &bytes)
}
