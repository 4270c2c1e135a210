//! A simulated network for the CPG layer: seeded loss and delay, crashes, partitions (symmetric,
//! one-way and bridged) and paused members, in virtual time. Every random choice comes from one
//! seeded generator, so a seed replays.
//!
//! The CPG talks in request/response exchanges (a ping goes follower → leader and its answer
//! back; an append goes leader → follower and its acknowledgement back). The network carries
//! the two halves of an exchange as two separate messages: the request over the link
//! caller → callee, the response over the link callee → caller. A link is cut per direction,
//! so a one-way cut of A → B loses A's requests to B *and* A's responses to B's requests.
//! B's requests still reach A and are acted on, but B never hears the outcome: no exchange
//! between the two completes, yet B can still change A's state (a leader B still appends to
//! a follower A, which applies what B has committed; A's pings to B are lost).
//!
//! Members' clocks may run at different rates (see `super::skewed`). The one number that
//! crosses between clocks, a lease grant, is restated in transit ([`SimNet::across_clocks`]).
//!
//! An exchange runs on its own task, as on a real server that reads a request off a
//! connection and handles it to the end whether or not the caller has given up waiting: a
//! caller that times out only stops listening for the response.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand08::rngs::StdRng;
use rand08::{Rng, SeedableRng};
use tokio::sync::oneshot;

use crate::cpg::service::Service;
use crate::cpg::transport::{BoxFuture, Transport, TransportError};
use crate::cpg::wire::{Envelope, Request, Response};

/// The side of a bridge member: it talks to every side.
pub(crate) const BRIDGE: u8 = u8::MAX;

struct State {
    rng: StdRng,
    services: BTreeMap<String, Arc<Service>>,
    /// Side of the partition each address is on; addresses on different sides cannot talk,
    /// except that an address on side [`BRIDGE`] talks to all.
    side: BTreeMap<String, u8>,
    /// Directed links `(from, to)` that lose every message, on top of `side`.
    cut: BTreeSet<(String, String)>,
    /// Paused addresses, each with the messages it holds, in the order they were held.
    paused: BTreeMap<String, VecDeque<oneshot::Sender<()>>>,
    loss_per_mille: u32,
    max_delay_ms: u64,
    /// The clock rate of the member at each address, per mille of virtual time.
    clocks: BTreeMap<String, u64>,
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
                cut: BTreeSet::new(),
                paused: BTreeMap::new(),
                loss_per_mille: 0,
                max_delay_ms,
                clocks: BTreeMap::new(),
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

    /// Puts each address on a side; unlisted addresses are on side 0. Replaces any earlier
    /// partition or one-way cut.
    pub fn partition(&self, side: BTreeMap<String, u8>) {
        let mut st = self.state.lock();
        st.side = side;
        st.cut.clear();
    }

    /// Loses every message sent over the directed link `from → to`, for each pair of the two
    /// lists; the opposite direction flows. Replaces any earlier partition or cut.
    pub fn cut_one_way(&self, from: &[String], to: &[String]) {
        let mut st = self.state.lock();
        st.side.clear();
        st.cut = from
            .iter()
            .flat_map(|f| to.iter().map(move |t| (f.clone(), t.clone())))
            .filter(|(f, t)| f != t)
            .collect();
    }

    /// Drops messages with this probability (per mille).
    pub fn set_loss(&self, loss_per_mille: u32) {
        self.state.lock().loss_per_mille = loss_per_mille;
    }

    /// Whether a message sent now from `from` to `to` can arrive (loss and pauses aside).
    pub fn reaches(&self, from: &str, to: &str) -> bool {
        Self::link_up(&self.state.lock(), from, to)
    }

    /// Pauses `addr`, as SIGSTOP would its process: from now on, messages it sends and
    /// messages that arrive for it are held, not lost, until [`SimNet::resume`].
    pub fn pause(&self, addr: &str) {
        self.state
            .lock()
            .paused
            .entry(addr.to_string())
            .or_default();
    }

    /// Resumes `addr`: what it held goes on, in the order it was held.
    pub fn resume(&self, addr: &str) {
        let held = self.state.lock().paused.remove(addr).unwrap_or_default();
        for release in held {
            // The message's task may be gone (its member crashed); nothing waits then.
            let _ = release.send(());
        }
    }

    /// Whether `addr` is paused.
    pub fn is_paused(&self, addr: &str) -> bool {
        self.state.lock().paused.contains_key(addr)
    }

    fn link_up(st: &State, from: &str, to: &str) -> bool {
        let (a, b) = (
            st.side.get(from).copied().unwrap_or(0),
            st.side.get(to).copied().unwrap_or(0),
        );
        let sides_talk = a == b || a == BRIDGE || b == BRIDGE;
        sides_talk && !st.cut.contains(&(from.to_string(), to.to_string()))
    }

    /// Waits while `addr` is paused: a message at a paused member, on its way out or in, waits
    /// for the resume, behind the messages held before it.
    async fn held_at(&self, addr: &str) {
        loop {
            let wait = {
                let mut st = self.state.lock();
                let Some(queue) = st.paused.get_mut(addr) else {
                    return;
                };
                let (release, wait) = oneshot::channel();
                queue.push_back(release);
                wait
            };
            // A dropped sender (the network went away) releases the message too.
            let _ = wait.await;
        }
    }

    /// One hop: `None` if lost, else its delay.
    fn hop(&self, from: &str, to: &str) -> Option<Duration> {
        let mut st = self.state.lock();
        let (loss_per_mille, max_delay_ms) = (st.loss_per_mille, st.max_delay_ms);
        let lost = st.rng.gen_range(0..1000) < loss_per_mille;
        let delay_ms = st.rng.gen_range(1..=max_delay_ms);
        (!lost && Self::link_up(&st, from, to)).then(|| Duration::from_millis(delay_ms))
    }

    /// Carries one message from `from` to `to`: held while the sender is paused, then lost or
    /// delayed, and lost if the link is cut when it arrives. `true` if it arrived.
    async fn travel(&self, from: &str, to: &str) -> bool {
        self.held_at(from).await;
        let Some(delay) = self.hop(from, to) else {
            return false;
        };
        tokio::time::sleep(delay).await;
        self.reaches(from, to)
    }

    /// One whole exchange: the request to `to`, its handling there (after any pause of `to`),
    /// the response back to `from` (after any pause of `from`). A lost message leaves `reply`
    /// unanswered, so the caller waits out its own timeout, as for a real lost packet.
    async fn carry(
        self,
        from: String,
        to: String,
        env: Envelope,
        reply: oneshot::Sender<Result<Response, TransportError>>,
    ) {
        if !self.travel(&from, &to).await {
            return;
        }
        let service = self.state.lock().services.get(&to).cloned();
        let Some(service) = service else {
            // Nobody listens there: like a TCP reset, the caller learns at once.
            let _ = reply.send(Err(TransportError::Unreachable(format!(
                "nothing listens at {to}"
            ))));
            return;
        };
        self.held_at(&to).await;
        let env = self.report_across_clocks(env, &from, &to);
        let resp = self.across_clocks(service.handle(env).await, &to, &from);
        if !self.travel(&to, &from).await {
            return;
        }
        self.held_at(&from).await;
        // The caller may have given up meanwhile.
        let _ = reply.send(Ok(resp));
    }

    /// A lease grant is a number of ms on the leader's clock that the pinger counts on its own
    /// (`Lease::granted`). A simulated member times in virtual ms (its durations already
    /// divided by its rate), so the grant a leader at `leader` computed becomes what a real one
    /// would send (× its rate), as the pinger at `pinger` will count it (÷ its rate).
    fn across_clocks(&self, mut resp: Response, leader: &str, pinger: &str) -> Response {
        if let Response::Pong { granted_ms, .. } = &mut resp {
            let st = self.state.lock();
            let rate = |addr: &str| st.clocks.get(addr).copied().unwrap_or(1000);
            let (l, p) = (rate(leader), rate(pinger));
            *granted_ms = (granted_ms.saturating_mul(l) + p / 2) / p;
        }
        resp
    }

    /// A ping's report (`since_older_ms`) is a number of ms on the pinger's clock that the
    /// leader counts on its own (`Lease::reported`): restated as for a grant, the other way.
    fn report_across_clocks(&self, mut env: Envelope, pinger: &str, leader: &str) -> Envelope {
        if let Request::Ping { since_older_ms, .. } = &mut env.req {
            let st = self.state.lock();
            let rate = |addr: &str| st.clocks.get(addr).copied().unwrap_or(1000);
            let (p, l) = (rate(pinger), rate(leader));
            *since_older_ms = since_older_ms.saturating_mul(p) / l;
        }
        env
    }

    /// A transport for the member at `from`, whose clock runs at `clock_per_mille` ms per
    /// 1000 ms of virtual time.
    pub fn transport(&self, from: &str, clock_per_mille: u64) -> Arc<dyn Transport> {
        self.state
            .lock()
            .clocks
            .insert(from.to_string(), clock_per_mille);
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
        let (reply, answer) = oneshot::channel();
        tokio::spawn(
            self.net
                .clone()
                .carry(self.from.clone(), addr.to_string(), env, reply),
        );
        match answer.await {
            Ok(resp) => resp,
            // Lost on the way there or back: no answer ever comes.
            Err(_) => std::future::pending().await,
        }
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
