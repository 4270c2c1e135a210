//! Errors of the CPG layer. Each says what went wrong and what the caller can do about it.

use thiserror::Error;

/// What a CPG call or the CPG member itself can fail with.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CpgError {
    /// A knob is out of range; the message names it.
    #[error("invalid CPG configuration: {0}")]
    Config(String),
    /// The cluster port could not be bound.
    #[error("cannot bind the cluster port {addr}: {reason}; pick a free address")]
    Bind {
        /// Address that was asked for.
        addr: String,
        /// What the OS said.
        reason: String,
    },
    /// No seed admitted this member in time.
    #[error(
        "no seed admitted this member within {timeout_ms} ms; check the seeds, the secret and that a majority is up"
    )]
    JoinTimeout {
        /// How long it tried.
        timeout_ms: u64,
    },
    /// The member's consensus state on disk cannot be read or written; the message names the
    /// file and the cause.
    #[error("consensus state in {dir}: {reason}")]
    Storage {
        /// The member's data directory.
        dir: String,
        /// What went wrong.
        reason: String,
    },
    /// A multicast meant for one view of its group was not delivered: the group changed.
    #[error("group {group} moved to view {view}; the multicast was not delivered")]
    ViewChanged {
        /// The group.
        group: String,
        /// Its view when the multicast was applied.
        view: u64,
    },
    /// The payload is larger than `max_payload_bytes`.
    #[error("payload of {len_bytes} bytes exceeds max_payload_bytes {max_bytes}; split it")]
    PayloadTooLarge {
        /// Size offered.
        len_bytes: usize,
        /// Limit in force.
        max_bytes: usize,
    },
    /// The operation needs a member of the group, and this member is not one.
    #[error("this member has not joined group {group:?}; join it first")]
    NotInGroup {
        /// Group named by the call.
        group: String,
    },
    /// The operation could not be committed (no leader reachable, no quorum); it may be retried.
    #[error("not committed: {0}; retry once the cluster has quorum")]
    NotCommitted(String),
    /// The exchange with the leader broke after the command was handed over: it may or may not
    /// be delivered. Deliveries tell which; do not blindly resend what must not repeat.
    #[error("outcome unknown: {0}; watch the deliveries before resending")]
    Indeterminate(String),
    /// The member has stopped (shut down, evicted, or overrun); start a new one to rejoin.
    #[error("the CPG member has stopped: {0}")]
    Stopped(StopReason),
}

/// Why a member stopped delivering. The application learns it from [`super::Cpg::stop_reason`]
/// once the event stream has ended.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The application asked for it.
    #[error("shut down by the application")]
    Shutdown,
    /// The majority removed this member (it was cut off or too slow); its deliveries may have a
    /// gap from here on, so it must restart as a new member.
    #[error("removed from the cluster by the majority; restart to rejoin")]
    Evicted,
    /// The application did not drain its events within `event_queue_len`.
    #[error("the application fell more than event_queue_len events behind")]
    Overrun,
    /// It lagged so far that the log it still needed was compacted away; restart to rejoin.
    #[error("fell behind the compacted log; restart to rejoin")]
    FellBehind,
}
