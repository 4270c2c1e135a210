//! Whole-cluster restarts of real broker processes (issue #11): a member keeps its consensus
//! state in its data directory, so a member started again on it is the same member, and a
//! member that holds cluster state never founds a new cluster. After a full stop it waits —
//! unready (`/readyz` 503 "waiting…"), refusing AMQP clients and wiring changes, reporting
//! no quorum — until a majority of its last configuration is back. Checked here: a full
//! restart in any order loses no wiring and no confirmed message; a lone restarted member
//! serves nobody; a leader frozen with SIGSTOP claims no quorum when it resumes after the
//! others moved on; twenty one-at-a-time crashes never leave the cluster stuck; and (root,
//! network namespaces) a founder restarted while cut off founds nothing; and every publish
//! forwarded to a primary and confirmed before it crashed is there when it is back.
//!
//! Members run on ports chosen before they start (`Ports::allocate`), so a restarted member
//! comes back at the addresses its peers know.

mod crash_cycles;
mod cut_off;
mod force_boot;
mod forwarded_crash;
mod full_restart;
mod harness;
mod lone_member;
mod replicated_catch_up;
mod replicated_cycles;
mod replicated_failover;
mod replicated_full_restart;
mod replicated_metrics;
mod replicated_paging;
mod sigstop;
mod transient_wiring;
