//! The CPG layer: Corosync-CPG-style process groups over openraft.
//!
//! A member joins named groups, multicasts bytes to them and reads one ordered stream of
//! [`CpgEvent`]s: deliveries and configuration changes, identical on every member of a group
//! between the same two configuration changes (virtual synchrony). Every multicast is an entry
//! of one Raft log and is delivered only once committed on a majority; a member that fails its
//! heartbeats is removed by a Raft membership change; a quorum lease makes a cut-off member
//! report lost quorum before the majority declares it failed. `docs/cpg.md` states the
//! guarantees and how each is tested.
//!
//! Entry point: [`Cpg::start`] with a [`CpgConfig`].

mod auth;
mod config;
mod disk;
mod error;
mod event;
mod groups;
mod lease;
mod log_store;
mod monitor;
mod network;
mod node;
mod runtime;
mod service;
mod state_machine;
mod tcp;
mod term_acks;
mod transport;
mod types;
mod wire;

#[cfg(test)]
pub(crate) mod sim;

pub use config::CpgConfig;
pub use error::{CpgError, StopReason};
pub use event::{CpgEvent, Member};
pub use node::{Cpg, CpgEvents, SyncPoint};
pub use runtime::seed_thread_rng;
pub use types::MemberId;
