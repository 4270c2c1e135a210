//! Knobs of the CPG layer, kept as a plain struct so the broker (or a test) can fill them from
//! flags, a file or code without this module knowing where they came from.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::error::CpgError;

/// Everything a CPG member needs to start. Defaults run a one-member group on an OS-assigned
/// loopback port with an empty secret, which is only useful in tests: a real cluster sets
/// `listen`, `seeds` and `secret`.
#[derive(Clone, Debug)]
pub struct CpgConfig {
    /// Address the cluster port binds; port 0 asks the OS for one (see [`super::Cpg::addr`]).
    pub listen: SocketAddr,
    /// Address other members dial to reach this one; `None` means the bound address. Set it when
    /// `listen` is a wildcard such as `0.0.0.0`.
    pub advertise: Option<String>,
    /// Addresses (`host:port`) of members to ask for admission. Empty means "found a new
    /// cluster": only the first member of a cluster may start with no seeds.
    pub seeds: Vec<String>,
    /// Shared cluster secret; a peer that cannot prove it knows it is refused.
    pub secret: Vec<u8>,
    /// Where the member's consensus state (id, vote, log, snapshot) lives. With it, a restarted
    /// process is the same member and never founds a cluster; `None` keeps everything in
    /// memory and makes every process a new member.
    pub data_dir: Option<PathBuf>,
    /// Events up to this index reached the application, durably, before a restart: the
    /// replay of the log starts after it (0: the application has nothing).
    pub resume_after: u64,
    /// How often the leader heartbeats followers and every member renews its quorum lease.
    pub heartbeat_ms: u64,
    /// Lower bound of the randomised election timeout; the upper bound is twice this.
    pub election_timeout_ms: u64,
    /// How long a member keeps believing it has quorum after its last confirmed contact with a
    /// leader that had quorum. A member cut off from the majority reports quorum lost within it.
    pub lease_ms: u64,
    /// How long the leader waits without hearing from a member before it proposes its removal.
    /// Must exceed `2 * lease_ms + heartbeat_ms`, so that the removed member's lease (granted by
    /// this or a previous leader) has run out first.
    pub failure_timeout_ms: u64,
    /// Upper bound of one request/response exchange with a peer, connect included.
    pub rpc_timeout_ms: u64,
    /// Pause between two admission attempts while joining.
    pub join_retry_ms: u64,
    /// How long `Cpg::start` keeps trying to be admitted before it gives up.
    pub join_timeout_ms: u64,
    /// Events buffered for the application; a member whose application falls further behind is
    /// stopped (and so removed by the others) rather than allowed to hold memory or the group.
    pub event_queue_len: usize,
    /// A follower whose log lags the leader by more than this many entries for longer than
    /// `failure_timeout_ms` is granted no more lease, and declared failed a `failure_timeout_ms`
    /// later: a slow member never holds the group back.
    pub max_lag_entries: u64,
    /// Committed entries kept in memory after a snapshot, so a briefly slow follower catches up
    /// from the log.
    pub log_keep_entries: u64,
    /// Largest payload a multicast may carry.
    pub max_payload_bytes: usize,
    /// Largest frame accepted on the cluster port (bounds what a peer can make us allocate).
    pub max_frame_bytes: usize,
    /// Most entries sent in one append request, so one request stays within `max_frame_bytes`.
    pub max_entries_per_append: u64,
}

impl Default for CpgConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            seeds: Vec::new(),
            secret: Vec::new(),
            data_dir: None,
            resume_after: 0,
            heartbeat_ms: 50,
            election_timeout_ms: 120,
            lease_ms: 300,
            failure_timeout_ms: 700,
            rpc_timeout_ms: 250,
            join_retry_ms: 100,
            join_timeout_ms: 10_000,
            event_queue_len: 16_384,
            max_lag_entries: 50_000,
            log_keep_entries: 1_000,
            max_payload_bytes: 1 << 20,
            max_frame_bytes: 64 << 20,
            max_entries_per_append: 256,
        }
    }
}

impl CpgConfig {
    /// Rejects settings under which the guarantees in `docs/cpg.md` would not hold, naming the
    /// knob to change.
    pub fn validate(&self) -> Result<(), CpgError> {
        let bad = |why: String| Err(CpgError::Config(why));
        if self.heartbeat_ms == 0 {
            return bad("heartbeat_ms must be > 0".into());
        }
        if self.election_timeout_ms <= 2 * self.heartbeat_ms {
            return bad(format!(
                "election_timeout_ms ({}) must exceed 2 * heartbeat_ms ({})",
                self.election_timeout_ms, self.heartbeat_ms
            ));
        }
        if self.lease_ms <= self.heartbeat_ms {
            return bad(format!(
                "lease_ms ({}) must exceed heartbeat_ms ({})",
                self.lease_ms, self.heartbeat_ms
            ));
        }
        let min_failure_ms = 2 * self.lease_ms + self.heartbeat_ms;
        if self.failure_timeout_ms <= min_failure_ms {
            return bad(format!(
                "failure_timeout_ms ({}) must exceed 2 * lease_ms + heartbeat_ms ({min_failure_ms})",
                self.failure_timeout_ms
            ));
        }
        if self.event_queue_len == 0 || self.max_entries_per_append == 0 {
            return bad("event_queue_len and max_entries_per_append must be > 0".into());
        }
        if self.max_payload_bytes.saturating_mul(2) > self.max_frame_bytes {
            return bad("max_frame_bytes must be at least 2 * max_payload_bytes".into());
        }
        Ok(())
    }
}
