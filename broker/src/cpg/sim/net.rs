//! A simulated network for the CPG layer: seeded loss and delay, crashes and partitions, in
//! virtual time. Every random choice comes from one seeded generator, so a seed replays.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};

use crate::cpg::service::Service;
use crate::cpg::transport::{BoxFuture, Transport, TransportError};
use crate::cpg::wire::{Envelope, Response};

struct State {
    rng: StdRng,
    services: BTreeMap<String, Arc<Service>>,
    /// Side of the partition each address is on; addresses on different sides cannot talk.
    side: BTreeMap<String, u8>,
    loss_per_mille: u32,
    max_delay_ms: u64,
}

/// The shared network every simulated member talks through.
#[derive(Clone)]
pub(crate) struct SimNet {
    state: Arc<Mutex<State>>,
}

impl SimNet {
    /// An empty network drawing its randomness from `seed`.
    pub fn new(seed: u64, max_delay_ms: u64) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                rng: StdRng::seed_from_u64(seed),
                services: BTreeMap::new(),
                side: BTreeMap::new(),
                loss_per_mille: 0,
                max_delay_ms,
            })),
        }
    }

    /// The harness's own random choices, from the same generator.
    pub fn gen_range(&self, lo: u64, hi_exclusive: u64) -> u64 {
        self.state.lock().rng.gen_range(lo..hi_exclusive)
    }

    /// `addr` now answers with `service` (a started or restarted member).
    pub fn register(&self, addr: &str, service: Arc<Service>) {
        self.state.lock().services.insert(addr.to_string(), service);
    }

    /// `addr` stops answering (a crash).
    pub fn unregister(&self, addr: &str) {
        self.state.lock().services.remove(addr);
    }

    /// Puts each address on a side; unlisted addresses are on side 0.
    pub fn partition(&self, side: BTreeMap<String, u8>) {
        self.state.lock().side = side;
    }

    /// Drops messages with this probability (per mille).
    pub fn set_loss(&self, loss_per_mille: u32) {
        self.state.lock().loss_per_mille = loss_per_mille;
    }

    fn connected(st: &State, a: &str, b: &str) -> bool {
        st.side.get(a).copied().unwrap_or(0) == st.side.get(b).copied().unwrap_or(0)
    }

    /// One hop: `None` if lost, else its delay.
    fn hop(&self, from: &str, to: &str) -> Option<Duration> {
        let mut st = self.state.lock();
        let (loss_per_mille, max_delay_ms) = (st.loss_per_mille, st.max_delay_ms);
        let lost = st.rng.gen_range(0..1000) < loss_per_mille;
        let delay_ms = st.rng.gen_range(1..=max_delay_ms);
        (!lost && Self::connected(&st, from, to)).then(|| Duration::from_millis(delay_ms))
    }

    /// A transport for the member at `from`.
    pub fn transport(&self, from: &str) -> Arc<dyn Transport> {
        Arc::new(SimTransport {
            net: self.clone(),
            from: from.to_string(),
        })
    }
}

struct SimTransport {
    net: SimNet,
    from: String,
}

impl SimTransport {
    async fn exchange(&self, addr: &str, env: Envelope) -> Result<Response, TransportError> {
        let Some(there) = self.net.hop(&self.from, addr) else {
            return std::future::pending().await;
        };
        tokio::time::sleep(there).await;
        let (connected, service) = {
            let st = self.net.state.lock();
            (
                SimNet::connected(&st, &self.from, addr),
                st.services.get(addr).cloned(),
            )
        };
        if !connected {
            return std::future::pending().await;
        }
        let Some(service) = service else {
            // Nobody listens there: like a TCP reset, the caller learns at once.
            return Err(TransportError::Unreachable(format!(
                "nothing listens at {addr}"
            )));
        };
        let resp = service.handle(env).await;
        let Some(back) = self.net.hop(addr, &self.from) else {
            return std::future::pending().await;
        };
        tokio::time::sleep(back).await;
        Ok(resp)
    }
}

impl Transport for SimTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        env: Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Response, TransportError>> {
        Box::pin(async move {
            let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
            tokio::time::timeout(timeout, self.exchange(addr, env))
                .await
                .unwrap_or(Err(TransportError::Timeout(timeout_ms)))
        })
    }
}
