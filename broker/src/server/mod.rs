//! The broker process: listeners, the registry of live connections, and the periodic work
//! (time for the vhosts, the memory watermark). Each connection runs as one task in
//! [`connection`].

pub mod channel;
pub mod connection;
pub mod outbox;
pub mod registry;
pub mod stats;

use crate::auth::UserStore;
use crate::config::Config;
use crate::core::{Effects, VHost};
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
}

impl Broker {
    /// A broker with the configured vhosts and users.
    pub fn new(config: Config) -> Arc<Self> {
        let seed = now_ms() ^ u64::from(std::process::id()).rotate_left(32);
        let vhosts = config
            .vhosts
            .iter()
            .enumerate()
            .map(|(i, name)| {
                (
                    name.clone(),
                    Arc::new(Mutex::new(VHost::new(name, seed.wrapping_add(i as u64)))),
                )
            })
            .collect();
        Arc::new(Self {
            users: UserStore::new(config.users.clone(), &config.vhosts),
            stats: stats::BrokerStats::default(),
            registry: registry::Registry::default(),
            config,
            vhosts: RwLock::new(vhosts),
            outboxes: RwLock::new(HashMap::new()),
            next_conn_id: AtomicU64::new(1),
            blocked: AtomicBool::new(false),
        })
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
        let mut i = 0;
        while i < fx.deliveries.len() {
            let conn = fx.deliveries[i].channel.conn;
            if conn == own {
                i += 1;
                continue;
            }
            // Move every delivery for `conn` in one push.
            let mut batch = Vec::new();
            let mut j = i;
            while j < fx.deliveries.len() {
                if fx.deliveries[j].channel.conn == conn {
                    batch.push(fx.deliveries.remove(j));
                } else {
                    j += 1;
                }
            }
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

    fn set_blocked(&self, blocked: bool) {
        if self.blocked.swap(blocked, Ordering::Relaxed) != blocked {
            tracing::warn!(
                blocked,
                "memory high watermark {}",
                if blocked {
                    "exceeded: blocking publishers"
                } else {
                    "cleared: unblocking publishers"
                }
            );
            for outbox in self.outboxes.read().values() {
                outbox.push(|p| p.blocked = Some(blocked));
            }
        }
    }
}

/// A running broker: the listener's address and the task serving it.
pub struct Running {
    /// The address the AMQP listener is bound to (useful with port 0).
    pub amqp_addr: SocketAddr,
    /// Shared state.
    pub broker: Arc<Broker>,
}

/// Binds the listener and starts serving: connections, vhost ticks and the memory monitor.
pub async fn start(config: Config) -> std::io::Result<Running> {
    let listener = TcpListener::bind(config.amqp_listen).await?;
    let amqp_addr = listener.local_addr()?;
    let broker = Broker::new(config);
    let _ = broker.registry.amqp_addr.set(amqp_addr);
    tokio::spawn(accept_loop(listener, broker.clone()));
    tokio::spawn(tick_loop(broker.clone()));
    tokio::spawn(memory_monitor(broker.clone()));
    Ok(Running { amqp_addr, broker })
}

async fn accept_loop(listener: TcpListener, broker: Arc<Broker>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(connection::serve(broker.clone(), stream, peer));
            }
            Err(e) => {
                // Out of file descriptors and the like: say so, back off, keep serving.
                tracing::warn!(error = %e, "accept failed");
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
            broker.route_effects(0, &mut fx);
        }
    }
}

/// Resident set size of this process in bytes (Linux), or None elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

async fn memory_monitor(broker: Arc<Broker>) {
    let mut interval = tokio::time::interval(Duration::from_millis(250));
    loop {
        interval.tick().await;
        if let Some(rss) = rss_bytes() {
            broker.set_blocked(rss > broker.config.memory_high_watermark_bytes);
        }
    }
}
