//! The broker's shared state: the vhosts, the journal, the users, the mailboxes of live
//! connections and the resource alarms — everything a connection, the admin API and the
//! cluster layer act on, and nothing about sockets.
//!
//! Every batch of vhost commands, whoever runs it (a connection, the admin API, a committed
//! cluster op, the tick), ends in [`Broker::finish_batch`]: bodies paged out are read back,
//! effects for other connections go to their mailboxes, durable changes go to the journal.
//! The socket side is [`crate::server`]; the cluster layer reaches this state only through
//! the trait it owns ([`crate::cluster::ClusterHost`], implemented in [`cluster_host`]).

mod batch;
pub mod cluster_host;
pub mod connections;
pub mod drain;
pub mod fragments;
pub mod majority;
pub mod outbox;
mod persist;
mod replication;
pub mod resources;
mod sessions;
pub mod stats;
mod vhosts;

use crate::auth::UserStore;
use crate::config::Config;
use crate::core::FastHashMap;
use crate::core::VHost;
use crate::store::journal::Journal;
use crate::store::{DataDir, StoreError};
use outbox::Outbox;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The queue.declare argument that names the member a queue lives on.
pub const PRIMARY_ARGUMENT: &str = "qpid.cluster.primary";

/// The declare argument that makes a queue or an exchange a proxy for the one of the same
/// name on another AMQP broker (`amqp://user:pass@host:port/vhost`) or on a cluster member.
pub use crate::core::PROXY_ARGUMENT;

/// What a `qpid.cluster.proxy` argument names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyTarget {
    /// Another AMQP broker, by its URI (checked for form): a foreign proxy.
    Foreign(String),
    /// A member of this broker's cluster, by node id: its queues and the shared exchanges
    /// are proxied by every member already, so the declare only checks they exist.
    Member(String),
}

/// State shared by every connection of the broker.
#[derive(Debug)]
pub struct Broker {
    /// Configuration in force.
    pub config: Config,
    /// Users and their permissions (changed at run time by the admin API).
    pub users: UserStore,
    /// Message and byte counters for `/metrics`.
    pub stats: stats::BrokerStats,
    /// Live connections and this node's state, for the admin API.
    pub registry: connections::Registry,
    vhosts: RwLock<HashMap<String, Arc<Mutex<VHost>>>>,
    outboxes: RwLock<FastHashMap<u64, Arc<Outbox>>>,
    /// Resumable sessions (`docs/sessions.md`).
    sessions: crate::session::Sessions,
    next_conn_id: AtomicU64,
    blocked: AtomicBool,
    blocked_reason: Mutex<&'static str>,
    /// The journal all durable queues write to.
    pub journal: Journal,
    /// This broker's cluster membership, once it joined (never set when standalone).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// Shared queues (vhost, name) whose retirement is being committed through the cluster.
    retiring: Arc<Mutex<std::collections::HashSet<(String, String)>>>,
    /// Links to the other members and foreign brokers, for proxied queues.
    proxies: crate::proxy::Proxies,
    /// Replication of this member's primaries to their backups.
    replicator: Arc<crate::replication::replicator::Replicator>,
    /// What the replicator reaches the broker through, once it joined a cluster.
    replication_host: std::sync::OnceLock<Arc<dyn crate::replication::replicator::ReplicationHost>>,
    /// Replicas on this member promoted to primary (see [`Broker::elections_won`]).
    elections_won: AtomicU64,
    /// Queues whose primary this member saw move to another member (see
    /// [`Broker::primaries_moved`]).
    primaries_moved: AtomicU64,
    /// Whether the listeners accept clients: a cluster member only starts once it holds
    /// the cluster map, so no client sees a wiring the cluster does not have.
    serving: tokio::sync::watch::Sender<bool>,
    data_dir: DataDir,
}

/// A declare argument that must be a string, if present (406 when it is something else).
fn string_argument(
    arguments: &crate::amqp::FieldTable,
    key: &str,
) -> Result<Option<String>, crate::core::AmqpError> {
    use crate::amqp::AMQPValue;
    match arguments.inner().get(key) {
        None => Ok(None),
        Some(AMQPValue::LongString(s)) => {
            Ok(Some(String::from_utf8_lossy(s.as_bytes()).into_owned()))
        }
        Some(AMQPValue::ShortString(s)) => Ok(Some(s.to_string())),
        Some(other) => Err(crate::core::AmqpError::precondition(format!(
            "{key} must be a string, not {other:?}"
        ))),
    }
}

impl Broker {
    /// Opens the data directory, recovers what it holds into the configured vhosts and starts
    /// the journal.
    pub fn open(config: Config) -> Result<Arc<Self>, StoreError> {
        let data_dir = DataDir::open(&config.data_dir)?;
        let recovered = vhosts::recover(&config, &data_dir)?;
        let journal = Journal::start(
            data_dir.path.clone(),
            config.journal.clone(),
            recovered.disk,
            recovered.next_segment,
        )?;
        let proxies = crate::proxy::Proxies::default();
        let replicator = Arc::new(crate::replication::replicator::Replicator::new(
            proxies.links.clone(),
            config.catch_up_limits(),
        ));
        let sessions = crate::session::Sessions::new(crate::session::TimeoutLimits {
            default: Duration::from_secs(config.session_default_timeout_s),
            max: Duration::from_secs(config.session_max_timeout_s),
        });
        Ok(Arc::new(Self {
            users: UserStore::new(
                config.users.clone(),
                &recovered.names,
                config.password_hash_iterations,
            )
            .with_login_limit(
                config.login_failures_max,
                Duration::from_secs(config.login_failures_window_s),
            ),
            stats: stats::BrokerStats::default(),
            registry: connections::Registry::default(),
            config,
            vhosts: RwLock::new(recovered.vhosts),
            outboxes: RwLock::new(FastHashMap::default()),
            sessions,
            next_conn_id: AtomicU64::new(1),
            blocked: AtomicBool::new(false),
            blocked_reason: Mutex::new(""),
            journal,
            cluster: std::sync::OnceLock::new(),
            proxies,
            replicator,
            replication_host: std::sync::OnceLock::new(),
            elections_won: AtomicU64::new(0),
            primaries_moved: AtomicU64::new(0),
            retiring: Arc::default(),
            serving: tokio::sync::watch::channel(false).0,
            data_dir,
        }))
    }

    /// Lets the listeners accept clients (see `serving`).
    pub fn start_serving(&self) {
        self.serving.send_replace(true);
    }

    /// Waits until the listeners may accept clients.
    pub async fn serving(&self) {
        let mut rx = self.serving.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// This broker's cluster membership, if it is a cluster member.
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::Cluster>> {
        self.cluster.get()
    }

    /// Records the cluster this broker joined and opens its proxies: links to the other
    /// members, found by node id in the cluster's membership.
    pub fn joined(self: &Arc<Self>, cluster: Arc<crate::cluster::Cluster>) {
        let members = Arc::downgrade(&cluster);
        self.proxies
            .links
            .join(cluster.link_password().to_owned(), move |node| {
                let cluster = members.upgrade()?;
                cluster
                    .members()
                    .into_iter()
                    .filter_map(|m| m.info)
                    .find(|i| i.node_id == node)
                    .map(|i| i.amqp)
            });
        let _ = self.cluster.set(cluster);
        self.start_replication();
    }

    /// The node id of the member a queue declared with `arguments` lives on (its primary):
    /// the member named by `qpid.cluster.primary` (a node id or AMQP `host:port`; `""` means
    /// this one), else the one the queue's locator picks (`x-queue-leader-locator`, else the
    /// config's `queue_primary_locator`) given the `primaries` of the vhost's queues. `None`
    /// on a single broker, which owns everything; a name that is no member is 404 NOT_FOUND.
    pub fn queue_home<'p>(
        &self,
        arguments: &crate::amqp::FieldTable,
        primaries: impl IntoIterator<Item = &'p str>,
    ) -> Result<Option<String>, crate::core::AmqpError> {
        use crate::cluster::placement::{LOCATOR_ARGUMENT, PrimaryLocator};
        match self.proxy_target(arguments)? {
            Some(ProxyTarget::Foreign(uri)) => return Ok(Some(uri)),
            Some(ProxyTarget::Member(node)) => {
                return Err(crate::core::AmqpError::precondition(format!(
                    "{PROXY_ARGUMENT} names cluster member '{node}': its queues are proxied by \
                     every member already; declare the queue over AMQP to check it is there"
                )));
            }
            None => {}
        }
        let locator = match string_argument(arguments, LOCATOR_ARGUMENT)? {
            None => self.config.queue_primary_locator,
            Some(name) => PrimaryLocator::parse(&name).ok_or_else(|| {
                crate::core::AmqpError::precondition(format!(
                    "{LOCATOR_ARGUMENT}: unknown locator '{name}': use client-local or balanced"
                ))
            })?,
        };
        match string_argument(arguments, PRIMARY_ARGUMENT)?.as_deref() {
            Some("") => Ok(self.cluster().map(|c| c.node_id().to_owned())),
            None => Ok(self.cluster().map(|c| {
                let live: Vec<String> = c
                    .members()
                    .into_iter()
                    .filter_map(|m| m.info.map(|i| i.node_id))
                    .collect();
                locator.choose(c.node_id(), &live, primaries)
            })),
            Some(n) => self
                .member(n, PRIMARY_ARGUMENT)
                .map(|node| self.cluster().is_some().then_some(node)),
        }
    }

    /// What the `qpid.cluster.proxy` argument of a queue or exchange declare names, if it is
    /// there: another broker's URI (406 when malformed or beside `qpid.cluster.primary`) or
    /// a cluster member (404 when no member has that node id or AMQP `host:port`).
    pub fn proxy_target(
        &self,
        arguments: &crate::amqp::FieldTable,
    ) -> Result<Option<ProxyTarget>, crate::core::AmqpError> {
        let Some(named) = string_argument(arguments, PROXY_ARGUMENT)? else {
            return Ok(None);
        };
        if crate::core::is_foreign(&named) {
            return self
                .foreign_home(named, arguments)
                .map(|u| Some(ProxyTarget::Foreign(u)));
        }
        self.member(&named, PROXY_ARGUMENT)
            .map(|node| Some(ProxyTarget::Member(node)))
    }

    /// The node id of the member `name` names (its node id or AMQP `host:port`); this
    /// broker's own node id names it even when it is in no cluster. 404 NOT_FOUND naming
    /// `name` and the argument it came from otherwise.
    fn member(&self, name: &str, argument: &str) -> Result<String, crate::core::AmqpError> {
        let me = &self.config.node_id;
        let Some(cluster) = self.cluster() else {
            return if name == me {
                Ok(me.clone())
            } else {
                Err(crate::core::AmqpError::not_found(format!(
                    "no cluster member '{name}' ({argument}): this broker is not in a cluster"
                )))
            };
        };
        cluster
            .members()
            .into_iter()
            .filter_map(|m| m.info)
            .find(|i| i.node_id == name || i.amqp == name)
            .map(|i| i.node_id)
            .ok_or_else(|| {
                crate::core::AmqpError::not_found(format!(
                    "no cluster member '{name}' ({argument}): name a member's node id or AMQP host:port"
                ))
            })
    }

    /// What makes this broker's private queues on other brokers (the feeds of foreign
    /// exchanges, `proxy/feed.rs`) its own: on a cluster, a value derived from the cluster
    /// secret, the same on every member (whichever member is a queue's primary consumes
    /// the same private queue); on a single broker, its node id and data directory.
    pub fn feed_identity(&self) -> String {
        match self.cluster() {
            Some(cluster) => cluster.link_password().to_owned(),
            None => format!("{}|{}", self.config.node_id, self.data_dir.path.display()),
        }
    }

    /// The home of a foreign proxy: the other broker's URI, checked for form here (whether
    /// it has the queue or exchange is asked before the declare is carried out).
    fn foreign_home(
        &self,
        uri: String,
        arguments: &crate::amqp::FieldTable,
    ) -> Result<String, crate::core::AmqpError> {
        use crate::core::AmqpError;
        if arguments.inner().contains_key(PRIMARY_ARGUMENT) {
            return Err(AmqpError::precondition(format!(
                "{PRIMARY_ARGUMENT} and {PROXY_ARGUMENT} exclude each other: a proxy's queue \
                 lives on the other broker"
            )));
        }
        uri.parse::<amq_protocol::uri::AMQPUri>().map_err(|e| {
            AmqpError::precondition(format!(
                "{PROXY_ARGUMENT} is not a valid AMQP URI ({}): {e}",
                crate::proxy::link::redacted(&uri)
            ))
        })?;
        Ok(uri)
    }

    /// This broker's links and forwarders.
    pub fn proxies(&self) -> &crate::proxy::Proxies {
        &self.proxies
    }

    /// Registers a new connection; returns its id and mailbox.
    pub fn register(&self) -> (u64, Arc<Outbox>) {
        let id = self.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let outbox = Arc::new(Outbox::default());
        self.outboxes.write().insert(id, outbox.clone());
        (id, outbox)
    }

    /// Whether connection `id` is open (registered and not yet forgotten), or a session with
    /// that owner id lives (what it owns must stay while it waits for a resume).
    pub fn has_connection(&self, id: u64) -> bool {
        self.outboxes.read().contains_key(&id) || self.sessions.owns(id)
    }

    /// The broker's sessions.
    pub fn sessions(&self) -> &crate::session::Sessions {
        &self.sessions
    }

    /// Connection `id` resumed a session whose owner id is `owner`: from now on it is
    /// connection `owner`, so that what the vhosts keep by connection finds it.
    pub fn rekey_connection(&self, id: u64, owner: u64) {
        let mut outboxes = self.outboxes.write();
        if let Some(outbox) = outboxes.remove(&id) {
            outboxes.insert(owner, outbox);
        }
    }

    /// Forgets a closed connection.
    pub fn unregister(&self, id: u64) {
        self.outboxes.write().remove(&id);
        self.registry.remove(id);
    }

    /// Whether publishers are blocked (memory above the high watermark).
    pub fn publishers_blocked(&self) -> bool {
        self.blocked.load(Ordering::Relaxed)
    }

    /// Why publishers are blocked ("low on memory", "low on disk").
    pub fn blocked_reason(&self) -> &'static str {
        *self.blocked_reason.lock()
    }

    /// Blocks or unblocks publishers; every connection hears of a change through its mailbox.
    fn set_blocked(&self, blocked: bool, reason: &'static str) {
        *self.blocked_reason.lock() = reason;
        if self.blocked.swap(blocked, Ordering::Relaxed) != blocked {
            if blocked {
                tracing::warn!(reason, "resource alarm: blocking publishers");
            } else {
                tracing::warn!("resource alarm cleared: unblocking publishers");
            }
            for outbox in self.outboxes.read().values() {
                outbox.push(|p| p.blocked = Some(blocked));
            }
        }
    }
}
