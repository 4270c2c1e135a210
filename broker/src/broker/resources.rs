//! The resource alarms: resident memory above the high watermark or free disk below its
//! limit blocks publishers (`connection.blocked`) rather than let the process be killed by
//! the OOM killer or fill the disk under the journal.

use super::Broker;
use std::sync::Arc;
use std::time::Duration;

/// Resident set size of this process in bytes (Linux), or None elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Free bytes for unprivileged users on the file system holding `path`.
pub fn disk_free_bytes(path: &std::path::Path) -> Option<u64> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs writes into the struct we pass and reads the NUL-terminated path.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// Checks memory and disk four times a second and blocks or unblocks publishers. Runs for
/// the life of the broker.
pub async fn monitor(broker: Arc<Broker>) {
    let mut interval = tokio::time::interval(Duration::from_millis(250));
    loop {
        interval.tick().await;
        let memory_high =
            rss_bytes().is_some_and(|rss| rss > broker.config.memory_high_watermark_bytes);
        let disk_low = disk_free_bytes(&broker.config.data_dir)
            .is_some_and(|free| free < broker.config.disk_free_limit_bytes);
        let reason = match (memory_high, disk_low) {
            (true, _) => "low on memory",
            (false, true) => "low on disk",
            _ => "",
        };
        broker.set_blocked(memory_high || disk_low, reason);
    }
}
