//! Exchanges and bindings, driven by lapin against one broker.

use ringmq_tests::Broker;

#[path = "../suites/routing.rs"]
mod routing;
