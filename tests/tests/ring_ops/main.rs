//! Ring operations on a live cluster of real broker processes (issue #15): a queue's primary
//! moved to another member under confirmed load, by the admin API and by `ringmqctl`, and
//! a member drained.

mod drain;
mod move_queue;
