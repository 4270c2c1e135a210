//! ringmq: a clustered AMQP 0-9-1 message broker.
//!
//! Layers, from the wire inwards: [`amqp`] (frames and codes), [`server`] (connections and
//! channels on sockets), [`core`] (the pure vhost state machine). [`config`] and [`auth`] are
//! what an operator sets.

pub mod admin;
pub mod admin_client;
pub mod amqp;
pub mod auth;
pub mod client;
pub mod cluster;
pub mod config;
pub mod core;
pub mod cpg;
pub mod server;
pub mod store;
