//! The seam between the CPG member and the network: one request, one response, bounded in
//! time. TCP implements it for real clusters; the simulation implements it with seeded loss,
//! delay and partitions.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use thiserror::Error;

use super::wire::{Envelope, Response};

/// A boxed future, so transports can be chosen at run time.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a request got no response.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub(crate) enum TransportError {
    /// The peer could not be reached or the connection broke.
    #[error("peer unreachable: {0}")]
    Unreachable(String),
    /// No response within the deadline.
    #[error("no response within {0} ms")]
    Timeout(u64),
    /// The peer failed the cluster-secret handshake (or we failed its).
    #[error("cluster authentication failed: {0}")]
    Auth(String),
    /// A frame could not be encoded or decoded.
    #[error("bad frame: {0}")]
    Codec(String),
}

impl TransportError {
    /// Wraps an I/O error.
    pub fn io(e: std::io::Error) -> Self {
        TransportError::Unreachable(e.to_string())
    }
}

/// Sends a request to the member listening at an address and waits for its response.
pub(crate) trait Transport: Send + Sync + 'static {
    /// One exchange with `addr`, abandoned after `timeout`.
    fn call<'a>(
        &'a self,
        addr: &'a str,
        env: Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>>;
}
