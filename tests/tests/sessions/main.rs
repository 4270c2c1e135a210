//! Resumable sessions on one broker (`docs/sessions.md`), with real clients over real
//! sockets. One file per concept.

mod across_members;
mod failover_client;
mod publishing;
mod wire;
