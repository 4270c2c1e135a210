//! basic.*, confirms and transactions, driven by lapin against one broker.

use ringmq_tests::Broker;

#[path = "../suites/basic.rs"]
mod basic;
