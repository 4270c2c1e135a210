//! A broker as a cluster member: starts CPG, joins the cluster group, applies delivered
//! events to the broker's vhosts in agreed order, and answers the requests its own clients
//! made.

use super::map::{Action, ClusterMap, WiringStore};
use super::membership::{MemberInfo, MemberState, Membership};
use super::message::ClusterMsg;
use crate::core::AmqpError;
use crate::core::{OpReply, WiringOp};
use crate::cpg::{Cpg, CpgConfig, CpgError, CpgEvent, CpgEvents, MemberId};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{oneshot, watch};

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
    /// member shares (a Kubernetes headless Service), where the first pod finds nobody.
    pub found_if_no_seed_answers: bool,
}

/// Why a broker could not become a cluster member.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The CPG layer did not start or admit us.
    #[error("cluster layer: {0}")]
    Cpg(#[from] CpgError),
    /// No member sent the cluster map in time.
    #[error("no cluster map received within {0:?}")]
    NoSnapshot(Duration),
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
    /// Starts CPG, joins the cluster group and returns once this member holds the cluster
    /// map (at once for the founder; after the snapshot for a joiner).
    pub async fn start(
        host: impl ClusterHost,
        settings: ClusterSettings,
    ) -> Result<Arc<Cluster>, ClusterError> {
        let config = CpgConfig {
            listen: settings.listen,
            advertise: settings.advertise.clone(),
            seeds: settings.seeds.clone(),
            secret: settings.secret.clone(),
            failure_timeout_ms: settings.failure_timeout_ms,
            join_timeout_ms: settings.join_timeout.as_millis() as u64,
            ..CpgConfig::default()
        };
        let (cpg, events) = match Cpg::start(config.clone()).await {
            Err(CpgError::JoinTimeout { timeout_ms })
                if settings.found_if_no_seed_answers && !config.seeds.is_empty() =>
            {
                tracing::warn!(
                    timeout_ms,
                    "no seed admitted this member: founding the cluster (this member is the configured founder)"
                );
                Cpg::start(CpgConfig {
                    seeds: Vec::new(),
                    ..config
                })
                .await?
            }
            started => started?,
        };
        let cluster = Arc::new(Cluster {
            me: cpg.id(),
            cpg,
            node_id: settings.info.node_id.clone(),
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            membership: RwLock::new(Membership::default()),
        });
        let (synced_tx, mut synced_rx) = watch::channel(false);
        let applier = Applier {
            map: ClusterMap::new(cluster.me),
            host,
            cluster: cluster.clone(),
            info: settings.info,
            synced_tx,
        };
        tokio::spawn(applier.run(events));
        cluster.cpg.join(GROUP).await?;
        let waited = tokio::time::timeout(settings.join_timeout, synced_rx.wait_for(|s| *s)).await;
        if !matches!(waited, Ok(Ok(_))) {
            cluster.cpg.shutdown().await;
            return Err(ClusterError::NoSnapshot(settings.join_timeout));
        }
        tracing::info!(
            member = cluster.me,
            addr = cluster.cpg.addr(),
            "joined the cluster"
        );
        Ok(cluster)
    }

    /// Address of the cluster port (useful with port 0).
    pub fn addr(&self) -> &str {
        self.cpg.addr()
    }

    /// This member's node id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The members in ring order.
    pub fn members(&self) -> Vec<MemberState> {
        self.membership.read().members().to_vec()
    }

    /// AMQP addresses of the live members (`known-hosts`).
    pub fn known_hosts(&self) -> Vec<String> {
        self.membership.read().known_hosts()
    }

    /// Voters of the consensus group, dead ones included until they are removed.
    pub fn voters(&self) -> usize {
        self.cpg.voter_count()
    }

    /// Node id of the consensus leader as this member knows it: `None` during an election,
    /// or while the leader is not (yet) a member that announced itself in the cluster group.
    /// What an operator looks at first when the cluster stalls.
    pub fn leader(&self) -> Option<String> {
        let leader = self.cpg.leader()?;
        self.membership
            .read()
            .members()
            .iter()
            .find(|m| m.id == leader)
            .and_then(|m| m.info.as_ref())
            .map(|info| info.node_id.clone())
    }

    /// Whether this member currently holds quorum.
    pub fn has_quorum(&self) -> bool {
        *self.cpg.quorum().borrow()
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
    /// Tells the clients of every vhost the live members' AMQP addresses (`amq.qpid`).
    fn publish_known_hosts(&mut self, hosts: &[String]);
    /// Saves what must survive before the process exits (the journal).
    fn shutdown(&mut self);
}

/// Feeds the cluster group's events to the map, in agreed order, and carries out what it
/// asks for.
struct Applier<H> {
    map: ClusterMap,
    host: H,
    cluster: Arc<Cluster>,
    info: MemberInfo,
    synced_tx: watch::Sender<bool>,
}

impl<H: ClusterHost> Applier<H> {
    async fn run(mut self, mut events: CpgEvents) {
        while let Some(ev) = events.recv().await {
            if ev.group() != GROUP {
                continue;
            }
            if let CpgEvent::ConfChg {
                members,
                joined,
                left,
                failed,
                ..
            } = &ev
            {
                let addrs = |ms: &[crate::cpg::Member]| {
                    ms.iter().map(|m| m.addr.clone()).collect::<Vec<_>>()
                };
                tracing::info!(members = members.len(), joined = ?addrs(joined), left = ?addrs(left), failed = ?addrs(failed), "cluster membership changed");
            }
            match self.map.on_event(ev, &mut self.host) {
                Ok(actions) => self.act(actions),
                Err(e) => {
                    tracing::error!(error = %e, "cannot follow the cluster");
                    break;
                }
            }
        }
        // CPG stopped: evicted (cut off or too slow) or shut down. A member that is not in
        // the cluster must not go on serving a wiring it can no longer keep in step; its
        // supervisor restarts it and it rejoins with the others' map.
        tracing::error!(reason = ?self.cluster.cpg.stop_reason(), "this broker left the cluster; exiting so that it restarts and rejoins");
        self.host.shutdown();
        std::process::exit(3);
    }

    fn act(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::SendHello => self.multicast(ClusterMsg::Hello(self.info.clone())),
                Action::SendSnapshot { to, through } => {
                    let msg = self.map.snapshot(to, through, &mut self.host);
                    self.multicast(msg);
                }
                Action::Answer { request, outcome } => self.cluster.answer(request, outcome),
                Action::HostsChanged => {
                    *self.cluster.membership.write() = self.map.membership().clone();
                    self.publish_known_hosts();
                }
                Action::Synced => {
                    let _ = self.synced_tx.send(true);
                }
            }
        }
    }

    fn multicast(&self, msg: ClusterMsg) {
        let cluster = self.cluster.clone();
        tokio::spawn(async move {
            if let Err(e) = cluster.mcast(&msg).await {
                tracing::warn!(error = %e, "cluster multicast failed");
            }
        });
    }

    fn publish_known_hosts(&mut self) {
        let hosts = self.cluster.known_hosts();
        self.host.publish_known_hosts(&hosts);
    }
}
