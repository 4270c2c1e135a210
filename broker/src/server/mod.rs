//! The broker on sockets: listeners, the accept loops and one task per connection
//! ([`connection`]). The state the connections share is [`crate::broker::Broker`]; this
//! module only moves bytes between it and the network.

pub mod channel;
pub mod confirm_gate;
pub mod connection;
pub mod tls;
pub mod wiring;

use crate::broker::{Broker, resources};
use crate::clock::now_ms;
use crate::config::Config;
use crate::core::Effects;
use crate::session::directory::SessionOp;
use crate::store::StoreError;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

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
    tokio::spawn(crate::proxy::watch::watch_foreign(Arc::downgrade(&broker)));
    tokio::spawn(crate::proxy::feeds::run_feeds(Arc::downgrade(&broker)));
    tokio::spawn(resources::monitor(broker.clone()));
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
    // The sessions of lost members this member keeps, and since when they wait.
    let mut orphans = HashMap::new();
    loop {
        interval.tick().await;
        end_expired_sessions(&broker, &mut orphans);
        for (_, vhost) in broker.vhosts() {
            let mut v = vhost.lock();
            v.tick(now_ms(), &mut fx);
            broker.finish_batch(0, &mut v, &mut fx);
        }
    }
}

/// Sessions whose timeout ran out without a resume end: what they owned (exclusive queues)
/// goes, as when a connection without a session closes; on a cluster the end is committed
/// to the session directory, and the sessions this member keeps for a lost member end too.
fn end_expired_sessions(broker: &Arc<Broker>, orphans: &mut HashMap<String, std::time::Instant>) {
    let now = std::time::Instant::now();
    for ended in broker.sessions().expire(now) {
        tracing::info!(session = %ended.id, owner = ended.owner, "session expired without a resume");
        broker.release_session(&ended, false);
        if let Some(cluster) = broker.cluster() {
            broker.commit_session(SessionOp::End {
                id: ended.id.to_string(),
                member: cluster.node_id().to_owned(),
            });
        }
    }
    broker.end_orphaned_sessions(orphans, now);
}
