//! One virtual broker: a queue's messages live on its primary (the member it was declared
//! on), and every other member serves it through proxies — publish, consume, get, ack,
//! nack, purge and counts from any member, with real clients on real sockets. One file per
//! concept.

mod consumers;
mod exclusive;
mod failures;
mod lifecycle;
mod link;
mod naming;
mod one_queue;
mod placement;
mod prefetch;
mod support;
mod transactions;
