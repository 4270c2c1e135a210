//! The broker process: listeners, the registry of live connections, persistence hand-off,
//! and the periodic work (time for the vhosts, the memory and disk watermarks). Each
//! connection runs as one task in [`connection`].

pub mod channel;
pub mod connection;
pub mod outbox;
pub mod registry;
pub mod shared_wiring;
pub mod stats;
pub mod tls;

use crate::auth::UserStore;
use crate::config::Config;
use crate::core::{DeadLetter, DiskBody, Effects, Message, VHost};
use crate::store::journal::{Job, Journal};
use crate::store::record::{Record, records_from_ops};
use crate::store::{DataDir, StoreError};
use outbox::Outbox;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;

/// Milliseconds since the Unix epoch: the time the vhost core is given.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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
    pub registry: registry::Registry,
    vhosts: RwLock<HashMap<String, Arc<Mutex<VHost>>>>,
    outboxes: RwLock<HashMap<u64, Arc<Outbox>>>,
    next_conn_id: AtomicU64,
    blocked: AtomicBool,
    blocked_reason: Mutex<&'static str>,
    /// The journal all durable queues write to.
    pub journal: Journal,
    /// This broker's cluster membership, once it joined (never set when standalone).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Cluster>>,
    /// Whether the listeners accept clients: a cluster member only starts once it holds
    /// the cluster map, so no client sees a wiring the cluster does not have.
    serving: tokio::sync::watch::Sender<bool>,
    data_dir: DataDir,
}

/// Why the broker could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The data directory could not be used.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The listener could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, #[source] std::io::Error),
    /// The TLS certificate, key or CA could not be loaded.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}

impl Broker {
    /// Opens the data directory, recovers what it holds into the configured vhosts and starts
    /// the journal.
    pub fn open(config: Config) -> Result<Arc<Self>, StoreError> {
        let data_dir = DataDir::open(&config.data_dir)?;
        let started = std::time::Instant::now();
        let mut recovered = crate::store::recovery::recover(&data_dir.path)?;
        let read_ms = started.elapsed().as_millis() as u64;
        for line in &recovered.damage {
            tracing::warn!(damage = %line, "journal damage found during recovery");
        }
        if let Some(reason) = &recovered.snapshot_ignored {
            tracing::warn!(%reason, "snapshot ignored; recovering from the whole journal");
        }
        let seed = now_ms() ^ u64::from(std::process::id()).rotate_left(32);
        let now = now_ms();
        let mut vhosts = HashMap::new();
        let mut restored = 0usize;
        // The configured vhosts, and those the data dir holds durable objects for (created
        // at run time through the admin API).
        let mut names: Vec<String> = config.vhosts.clone();
        names.extend(
            recovered
                .disk
                .wiring
                .keys()
                .filter(|v| !config.vhosts.contains(v))
                .cloned(),
        );
        for (i, name) in names.iter().enumerate() {
            let mut vhost = VHost::new(name, seed.wrapping_add(i as u64));
            // Limits first: restoring messages pages out those beyond the memory budget.
            vhost.set_limits(config.vhost_limits());
            if let Some(wiring) = recovered.disk.wiring.get(name).cloned() {
                let queues: Vec<(u64, String)> = wiring
                    .queues
                    .iter()
                    .map(|q| (q.uid, q.name.clone()))
                    .collect();
                for skipped in vhost.restore_wiring(wiring, now) {
                    tracing::warn!(vhost = %name, %skipped, "durable object not restored");
                }
                for (uid, queue) in queues {
                    if let Some(messages) = recovered.messages.remove(&uid) {
                        restored += messages.len();
                        vhost.restore_messages(&queue, messages);
                    }
                }
            }
            vhost.set_record_ops(true);
            vhosts.insert(name.clone(), Arc::new(Mutex::new(vhost)));
        }
        tracing::info!(
            records = recovered.records,
            snapshot_records = recovered.snapshot_records,
            messages = restored,
            segments = recovered.disk.index.segments.len(),
            read_ms,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "recovery done"
        );
        let journal = Journal::start(
            data_dir.path.clone(),
            config.journal.clone(),
            recovered.disk,
            recovered.next_segment,
        )?;
        Ok(Arc::new(Self {
            users: UserStore::new(
                config.users.clone(),
                &names,
                config.password_hash_iterations,
            )
            .with_login_limit(
                config.login_failures_max,
                Duration::from_secs(config.login_failures_window_s),
            ),
            stats: stats::BrokerStats::default(),
            registry: registry::Registry::default(),
            config,
            vhosts: RwLock::new(vhosts),
            outboxes: RwLock::new(HashMap::new()),
            next_conn_id: AtomicU64::new(1),
            blocked: AtomicBool::new(false),
            blocked_reason: Mutex::new(""),
            journal,
            cluster: std::sync::OnceLock::new(),
            serving: tokio::sync::watch::channel(false).0,
            data_dir,
        }))
    }

    /// Hands every vhost's pending durable changes to the journal and waits until everything
    /// submitted so far is on disk: what the admin API does before it answers a change.
    pub async fn persist_all_and_wait(&self) {
        let mut fx = Effects::default();
        for (_, vhost) in self.vhosts() {
            let mut v = vhost.lock();
            self.persist(&mut v, &mut fx);
        }
        let target = self.journal.last_submitted();
        let mut synced = self.journal.synced();
        while *synced.borrow() < target {
            if synced.changed().await.is_err() {
                return;
            }
        }
    }

    /// Hands what a batch of commands changed in durable state to the journal: the durable
    /// wiring if it changed, and the records of durable queues' ops. Call it while holding
    /// the vhost lock, so the journal sees changes in the vhost's order. Returns the
    /// journal sequence number that must be durable before this batch's replies go out,
    /// when there is one (a persistent message was enqueued or durable wiring changed).
    pub fn persist(&self, vhost: &mut VHost, fx: &mut Effects) -> Option<u64> {
        let mut gate = None;
        if vhost.take_wiring_changed() {
            gate = Some(self.journal.submit(Job::Wiring {
                vhost: vhost.name().to_owned(),
                wiring: vhost.durable_wiring(),
            }));
        }
        if !fx.ops.is_empty() || !fx.page_out.is_empty() {
            let mut records = Vec::new();
            records_from_ops(&fx.ops, &mut records);
            fx.ops.clear();
            records.extend(fx.page_out.drain(..).map(|p| Record::Paged {
                uid: p.uid,
                id: p.id,
                message: p.message,
            }));
            if !records.is_empty() {
                let must_sync = records.iter().any(|r| matches!(r, Record::Enqueued { .. }));
                if self.journal.body_bytes_in_flight() > MAX_BODY_BYTES_IN_FLIGHT {
                    // The writer is behind: every body queued for it is still in memory.
                    fx.backlogged = true;
                }
                let seq = self.journal.submit(Job::Records(records));
                if must_sync {
                    gate = Some(seq);
                }
            }
        }
        if !fx.page_released.is_empty() || !fx.queues_released.is_empty() {
            self.journal.submit(Job::Release {
                pages: std::mem::take(&mut fx.page_released),
                queues: std::mem::take(&mut fx.queues_released),
            });
        }
        gate
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

    /// Everything a batch of commands leaves to do, in the order that keeps it correct; call
    /// it while still holding the vhost lock. Bodies only on disk are read back first (dead
    /// letters, then deliveries), while the journal still holds them: this batch's removals
    /// reach the journal only after, in [`Broker::persist`]. Then effects for other
    /// connections go to their outboxes ([`Broker::route_effects`]). Returns the journal
    /// sequence number this batch's replies wait for, as `persist` does.
    pub fn finish_batch(&self, own: u64, vhost: &mut VHost, fx: &mut Effects) -> Option<u64> {
        self.resolve_paged(vhost, fx);
        self.route_effects(own, fx);
        self.persist(vhost, fx)
    }

    /// Reads back the bodies of this batch's paged dead letters (and re-runs their
    /// dead-lettering, which may page out and drop more) and of its deliveries.
    fn resolve_paged(&self, vhost: &mut VHost, fx: &mut Effects) {
        for _ in 0..MAX_DEAD_LETTER_ROUNDS {
            if fx.paged_dead_letters.is_empty() {
                break;
            }
            let dead = std::mem::take(&mut fx.paged_dead_letters);
            let keys: Vec<DiskBody> = dead
                .iter()
                .map(|d| d.message.body.on_disk().expect("paged dead letter"))
                .collect();
            let bodies = self.read_bodies(&keys);
            let resolved = dead
                .into_iter()
                .zip(bodies)
                .map(|(d, body)| DeadLetter {
                    message: Arc::new(d.message.with_body(body)),
                    ..d
                })
                .collect();
            vhost.dead_letter_resolved(resolved, now_ms(), fx);
        }
        if !fx.paged_dead_letters.is_empty() {
            tracing::warn!(
                vhost = %vhost.name(),
                dropped = fx.paged_dead_letters.len(),
                "dead-letter chain of paged messages too long; dropped the rest"
            );
            fx.paged_dead_letters.clear();
        }
        let (at, keys): (Vec<usize>, Vec<DiskBody>) = fx
            .deliveries
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.message.body.on_disk().map(|k| (i, k)))
            .unzip();
        if keys.is_empty() {
            return;
        }
        for (i, body) in at.into_iter().zip(self.read_bodies(&keys)) {
            let d = &mut fx.deliveries[i];
            d.message = Arc::new(d.message.with_body(body));
        }
    }

    /// `message` with its body in memory, read back from the journal when it was paged out
    /// (basic.get). Call it under the vhost lock that produced it, like [`Broker::finish_batch`].
    pub fn resolve_message(&self, message: Arc<Message>) -> Arc<Message> {
        match message.body.on_disk() {
            None => message,
            Some(key) => {
                let body = self.read_bodies(&[key]).pop().expect("one body per key");
                Arc::new(message.with_body(body))
            }
        }
    }

    /// Reads bodies back from the journal. A body the journal cannot give back is a broken
    /// promise of the store, like a failed write: the broker stops loudly rather than
    /// deliver something else or nothing. When the record is damaged or missing it first
    /// deletes the snapshot, so that the restart scans the journal and drops the damaged
    /// record (and what follows it in its segment) instead of failing on it again.
    fn read_bodies(&self, keys: &[DiskBody]) -> Vec<bytes::Bytes> {
        let seq = self.journal.last_submitted();
        match crate::store::paging::read_bodies(self.journal.index(), keys, seq) {
            Ok(bodies) => {
                self.journal
                    .stats
                    .bodies_read
                    .fetch_add(keys.len() as u64, Ordering::Relaxed);
                bodies
            }
            Err(e) => {
                tracing::error!(error = %e, "reading a paged-out body failed; stopping the broker");
                if !matches!(e, crate::store::paging::ReadError::Io { .. })
                    && let Err(e) = crate::store::snapshot::discard(&self.data_dir.path)
                {
                    tracing::error!(error = %e, "could not delete the snapshot");
                }
                std::process::exit(70);
            }
        }
    }

    /// A vhost by name.
    pub fn vhost(&self, name: &str) -> Option<Arc<Mutex<VHost>>> {
        self.vhosts.read().get(name).cloned()
    }

    /// Registers a new connection; returns its id and mailbox.
    pub fn register(&self) -> (u64, Arc<Outbox>) {
        let id = self.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let outbox = Arc::new(Outbox::default());
        self.outboxes.write().insert(id, outbox.clone());
        (id, outbox)
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

    /// Hands effects meant for other connections to their mailboxes. Call it while still
    /// holding the vhost lock that produced them (see [`Outbox`]). Items for `own` are left
    /// in `fx` for the caller to write directly.
    pub fn route_effects(&self, own: u64, fx: &mut Effects) {
        if fx.deliveries.iter().all(|d| d.channel.conn == own)
            && fx.cancelled.iter().all(|c| c.channel.conn == own)
        {
            return;
        }
        let outboxes = self.outboxes.read();
        // One pass: keep this connection's deliveries in order, group the others by target
        // (a batch reaches few connections, so a short list beats a map).
        let mut groups: Vec<(u64, Vec<crate::core::Delivery>)> = Vec::new();
        let mut mine = Vec::with_capacity(fx.deliveries.len());
        for d in fx.deliveries.drain(..) {
            let conn = d.channel.conn;
            if conn == own {
                mine.push(d);
            } else if let Some((_, group)) = groups.iter_mut().find(|(c, _)| *c == conn) {
                group.push(d);
            } else {
                groups.push((conn, vec![d]));
            }
        }
        fx.deliveries = mine;
        for (conn, batch) in groups {
            if let Some(outbox) = outboxes.get(&conn) {
                outbox.push(|p| p.deliveries.extend(batch));
            }
        }
        let (mine, others): (Vec<_>, Vec<_>) =
            fx.cancelled.drain(..).partition(|c| c.channel.conn == own);
        fx.cancelled = mine;
        for c in others {
            if let Some(outbox) = outboxes.get(&c.channel.conn) {
                outbox.push(|p| p.cancelled.push(c));
            }
        }
    }

    /// Why publishers are blocked ("low on memory", "low on disk").
    pub fn blocked_reason(&self) -> &'static str {
        *self.blocked_reason.lock()
    }

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

/// Body bytes waiting for the journal writer above which a connection that hands it more is
/// paced like a publisher to a backlogged queue.
const MAX_BODY_BYTES_IN_FLIGHT: u64 = 16 * 1024 * 1024;

/// Most rounds of reading paged dead letters back per batch: a dead letter whose enqueue
/// pushes out another paged message (drop-head) makes another round.
const MAX_DEAD_LETTER_ROUNDS: usize = 64;

/// A running broker: the listeners' addresses and the shared state.
pub struct Running {
    /// The address the plaintext AMQP listener is bound to (useful with port 0); None when
    /// it is disabled (`amqp_listen_enabled: false`).
    pub amqp_addr: Option<SocketAddr>,
    /// The address the TLS (amqps) listener is bound to, when one is configured.
    pub amqps_addr: Option<SocketAddr>,
    /// Shared state.
    pub broker: Arc<Broker>,
}

/// Recovers the data directory, binds the listeners and starts serving: connections, vhost
/// ticks, the resource monitor and the TLS certificate reloader.
pub async fn start(config: Config) -> Result<Running, StartError> {
    // TLS files are checked before the data directory is touched: a typo fails fast.
    let tls = tls::TlsFiles::from_config(&config)?
        .map(tls::TlsState::new)
        .transpose()?
        .map(Arc::new);
    let broker = Broker::open(config)?;
    let bind = |addr: SocketAddr| async move {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| StartError::Listen(addr, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| StartError::Listen(addr, e))?;
        Ok::<_, StartError>((listener, local))
    };
    if broker.config.cluster_listen.is_none() {
        broker.start_serving();
    }
    let mut amqp_addr = None;
    if broker.config.amqp_listen_enabled {
        let (listener, local) = bind(broker.config.amqp_listen).await?;
        let _ = broker.registry.amqp_addr.set(local);
        amqp_addr = Some(local);
        tokio::spawn(accept_loop(listener, broker.clone()));
    }
    let mut amqps_addr = None;
    if let (Some(addr), Some(tls)) = (broker.config.amqps_listen, tls) {
        let (listener, local) = bind(addr).await?;
        amqps_addr = Some(local);
        let interval = Duration::from_secs(broker.config.tls_reload_interval_s);
        tokio::spawn(tls::reload_loop(tls.clone(), interval));
        tokio::spawn(tls_accept_loop(listener, broker.clone(), tls));
    }
    tokio::spawn(tick_loop(broker.clone()));
    tokio::spawn(memory_monitor(broker.clone()));
    Ok(Running {
        amqp_addr,
        amqps_addr,
        broker,
    })
}

async fn accept_loop(listener: TcpListener, broker: Arc<Broker>) {
    broker.serving().await;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(connection::serve(broker.clone(), stream, peer, None));
            }
            Err(e) => {
                // Out of file descriptors and the like: say so, back off, keep serving.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Accepts TLS connections: the handshake runs on the connection's own task (a slow client
/// never holds up the accept loop) and is bounded by `handshake_timeout_s`.
async fn tls_accept_loop(listener: TcpListener, broker: Arc<Broker>, tls: Arc<tls::TlsState>) {
    let asks_for_cert = tls.files().asks_for_client_cert();
    broker.serving().await;
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
                let broker = broker.clone();
                tokio::spawn(async move {
                    let timeout = Duration::from_secs(broker.config.handshake_timeout_s);
                    let stream = match tokio::time::timeout(timeout, acceptor.accept(stream)).await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::info!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    // A certificate is only there if the verifier accepted it.
                    let external = asks_for_cert
                        .then(|| stream.get_ref().1.peer_certificates())
                        .flatten()
                        .and_then(|chain| chain.first())
                        .and_then(|leaf| tls::subject_common_name(leaf));
                    connection::serve(broker, stream, peer, Some(connection::TlsPeer { external }))
                        .await;
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed (amqps)");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// How often the vhosts are given the time (message TTL, queue expiry).
const TICK: Duration = Duration::from_millis(100);

async fn tick_loop(broker: Arc<Broker>) {
    let mut interval = tokio::time::interval(TICK);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut fx = Effects::default();
    loop {
        interval.tick().await;
        for (_, vhost) in broker.vhosts() {
            let mut v = vhost.lock();
            v.tick(now_ms(), &mut fx);
            broker.finish_batch(0, &mut v, &mut fx);
        }
    }
}

/// Resident set size of this process in bytes (Linux), or None elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Free bytes for unprivileged users on the file system holding `path`.
pub fn disk_free_bytes(path: &std::path::Path) -> Option<u64> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs writes into the struct we pass and reads the NUL-terminated path.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}

async fn memory_monitor(broker: Arc<Broker>) {
    let mut interval = tokio::time::interval(Duration::from_millis(250));
    loop {
        interval.tick().await;
        let memory_high =
            rss_bytes().is_some_and(|rss| rss > broker.config.memory_high_watermark_bytes);
        let disk_low = disk_free_bytes(&broker.config.data_dir)
            .is_some_and(|free| free < broker.config.disk_free_limit_bytes);
        let reason = match (memory_high, disk_low) {
            (true, _) => "low on memory",
            (false, true) => "low on disk",
            _ => "",
        };
        broker.set_blocked(memory_high || disk_low, reason);
    }
}
