//! ringmq: a clustered AMQP 0-9-1 message broker.
//!
//! Layers, from the wire inwards: [`amqp`] (frames and codes), [`server`] (connections and
//! channels on sockets), [`broker`] (the state they share: vhosts, journal hand-off, mailboxes),
//! [`core`] (the pure vhost state machine), [`store`] (the journal). Beside them: [`cluster`]
//! (the replicated cluster map, reaching the broker through its own trait) over [`cpg`] (the
//! process-group layer), and [`admin`] (the HTTP API). [`config`] and [`auth`] are what an
//! operator sets. `docs/architecture.md` follows one publish through these files.

pub mod admin;
pub mod admin_client;
pub mod amqp;
pub mod atomic_file;
pub mod auth;
pub mod broker;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod core;
pub mod cpg;
pub mod proxy;
pub mod replication;
pub mod server;
pub mod session;
pub mod store;
