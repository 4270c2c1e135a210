//! The suites that define single-broker behaviour (routing, queues, basic, confirms,
//! transactions, dead-lettering, TTL), run unchanged on a three-member cluster: connections
//! go to the members in turn and queue primaries are spread over them, so the declaring
//! client and the using client are mostly on different members, and every publish, consume,
//! ack and count that crosses members goes through a proxy (issue #12).

use ringmq_tests::cluster::VirtualBroker as Broker;

#[path = "../suites/basic.rs"]
mod basic;
#[path = "../suites/queues.rs"]
mod queues;
#[path = "../suites/routing.rs"]
mod routing;
