//! Wall-clock time for the edges. The vhost core and the cluster map take time as an input
//! (deterministic, testable); only the tasks that feed them read the clock, here.

/// Milliseconds since the Unix epoch: the time the vhost core is given.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
