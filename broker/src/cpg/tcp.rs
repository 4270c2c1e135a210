//! The real transport: authenticated TCP connections on the cluster port, pooled per peer,
//! every exchange bounded by a deadline and every frame by `max_frame_bytes`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::auth;
use super::service::Service;
use super::transport::{BoxFuture, Transport, TransportError};
use super::wire::{Envelope, Response, read_frame, write_frame};

/// Idle connections kept per peer; more concurrent exchanges dial extra connections that are
/// closed afterwards.
const IDLE_CONNS_PER_PEER: usize = 4;
/// Inbound connections served at once; a flood of dialers cannot exhaust tasks or memory.
const MAX_INBOUND_CONNS: usize = 256;

/// Dials peers, authenticates, and reuses connections.
pub(crate) struct TcpTransport {
    secret: Arc<Vec<u8>>,
    max_frame_bytes: usize,
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
}

impl TcpTransport {
    /// A transport proving `secret` to every peer it dials.
    pub fn new(secret: Arc<Vec<u8>>, max_frame_bytes: usize) -> Self {
        Self {
            secret,
            max_frame_bytes,
            idle: Mutex::new(HashMap::new()),
        }
    }

    async fn exchange(&self, addr: &str, env: &Envelope) -> Result<Response, TransportError> {
        let pooled = self.idle.lock().get_mut(addr).and_then(Vec::pop);
        let mut stream = match pooled {
            Some(s) => s,
            None => {
                let mut s = TcpStream::connect(addr).await.map_err(TransportError::io)?;
                s.set_nodelay(true).map_err(TransportError::io)?;
                auth::dial(&mut s, &self.secret).await?;
                s
            }
        };
        write_frame(&mut stream, env).await?;
        let resp = read_frame(&mut stream, self.max_frame_bytes).await?;
        let mut idle = self.idle.lock();
        let conns = idle.entry(addr.to_string()).or_default();
        if conns.len() < IDLE_CONNS_PER_PEER {
            conns.push(stream);
        }
        Ok(resp)
    }
}

impl Transport for TcpTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        env: Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>> {
        Box::pin(async move {
            let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
            match tokio::time::timeout(timeout, self.exchange(addr, &env)).await {
                Ok(r) => r,
                Err(_) => Err(TransportError::Timeout(timeout_ms)),
            }
        })
    }
}

/// Accepts cluster connections and serves each with `service` after the secret handshake.
pub(crate) async fn serve(
    listener: TcpListener,
    service: Arc<Service>,
    secret: Arc<Vec<u8>>,
    max_frame_bytes: usize,
    handshake_timeout: Duration,
) {
    let slots = Arc::new(Semaphore::new(MAX_INBOUND_CONNS));
    // Owning the connection tasks means aborting `serve` closes every connection too.
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let Ok((mut stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!(%peer, "cluster port: too many connections, refusing");
            continue;
        };
        let service = Arc::clone(&service);
        let secret = Arc::clone(&secret);
        conns.spawn(async move {
            let _permit = permit;
            // A failing set_nodelay only costs latency.
            let _ = stream.set_nodelay(true);
            match tokio::time::timeout(handshake_timeout, auth::accept(&mut stream, &secret)).await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(%peer, member = service.id(), error = %e, "cluster peer refused");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, member = service.id(), "cluster peer refused: handshake timed out");
                    return;
                }
            }
            loop {
                let env: Envelope = match read_frame(&mut stream, max_frame_bytes).await {
                    Ok(env) => env,
                    Err(TransportError::Codec(e)) => {
                        tracing::warn!(%peer, error = %e, "cluster peer sent a bad frame, closing");
                        return;
                    }
                    Err(_) => return,
                };
                let resp = service.handle(env).await;
                if write_frame(&mut stream, &resp).await.is_err() {
                    return;
                }
            }
        });
    }
}
