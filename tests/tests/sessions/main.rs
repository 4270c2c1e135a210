//! Resumable sessions on one broker (`docs/sessions.md`), with real clients over real
//! sockets. One file per concept.

mod across_members;
mod competing_consumers;
mod exclusive_queues;
mod failover_client;
mod plain_clients;
mod publishing;
mod relay;
mod script;
mod scripted_kills;
mod transactions;
mod wire;
