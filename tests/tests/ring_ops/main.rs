//! Ring operations on a live cluster of real broker processes (issue #15): a queue's primary
//! moved to another member under confirmed load, by the admin API and by `ringmqctl`.

mod move_queue;
