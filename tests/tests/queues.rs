//! Queue declaration, deletion and the `x-` arguments, driven by lapin against one broker.

use ringmq_tests::Broker;

#[path = "../suites/queues.rs"]
mod queues;
