//! What the replicator has done and where it stands, for `/metrics`: running totals kept as
//! atomics (bumped once per frame or per catch-up event, never under a new lock), and gauges
//! computed at scrape time from the state the replicator keeps anyway.

use super::Replicator;
use crate::replication::catch_up::Phase;
use std::sync::atomic::{AtomicU64, Ordering};

/// Running totals for `/metrics`.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) frames: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) catch_ups_started: AtomicU64,
    pub(super) catch_ups_completed: AtomicU64,
    pub(super) catch_ups_abandoned: AtomicU64,
    pub(super) links_failed: AtomicU64,
}

/// What the replicator has done and where it stands, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicationStats {
    /// Frames handed to backup links (one per queue per batch per backup, and images).
    pub frames_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Frames sent and not yet acknowledged, over every backup: the replication lag.
    pub frames_unacked: u64,
    /// Batches whose confirms still wait for an in-sync backup.
    pub batches_waiting: u64,
    /// Catch-ups begun (an image sent to a backup new to a queue, or after a failure).
    pub catch_ups_started: u64,
    /// Catch-ups that ended with the backup committed in sync.
    pub catch_ups_completed: u64,
    /// Catch-ups given up (not done within the time limit, too many ops held back, a link
    /// failure, a body that could not be read) and retried from a new image.
    pub catch_ups_abandoned: u64,
    /// Catch-ups under way now.
    pub catch_ups_running: u64,
    /// Messages in the images of the catch-ups under way.
    pub catch_up_messages_total: u64,
    /// Of those, sent so far.
    pub catch_up_messages_sent: u64,
    /// Image chunk bytes the catch-ups under way sent so far.
    pub catch_up_bytes_sent: u64,
    /// Encoded ops held back by catch-ups under way until their last chunk is out.
    pub catch_up_held_bytes: u64,
    /// Backup links that failed or refused a frame.
    pub links_failed: u64,
    /// Replicated queues this member is primary of.
    pub queues: u64,
    /// Of their backups (counted per queue), how many are in sync.
    pub in_sync_backups: u64,
    /// And how many are not (catching up).
    pub catching_up_backups: u64,
}

impl Replicator {
    /// Totals and the current lag.
    pub fn stats(&self) -> ReplicationStats {
        let state = self.state.lock();
        let c = &self.counters;
        let (mut in_sync, mut catching_up) = (0, 0);
        for r in state.roles.values() {
            in_sync += r.in_sync.len() as u64;
            catching_up += (r.backups.len() - r.in_sync.len()) as u64;
        }
        let running = || {
            state
                .links
                .values()
                .flat_map(|l| l.catch_ups.values())
                .filter(|c| !matches!(c.phase, Phase::Abandoned(_)))
        };
        ReplicationStats {
            frames_sent: c.frames.load(Ordering::Relaxed),
            bytes_sent: c.bytes.load(Ordering::Relaxed),
            frames_unacked: state.links.values().map(|l| l.sent.len() as u64).sum(),
            batches_waiting: state.ledger.waiting(),
            catch_ups_started: c.catch_ups_started.load(Ordering::Relaxed),
            catch_ups_completed: c.catch_ups_completed.load(Ordering::Relaxed),
            catch_ups_abandoned: c.catch_ups_abandoned.load(Ordering::Relaxed),
            catch_ups_running: running().count() as u64,
            catch_up_messages_total: running().map(|c| c.messages_total).sum(),
            catch_up_messages_sent: running().map(|c| c.messages_sent).sum(),
            catch_up_bytes_sent: running().map(|c| c.bytes_sent).sum(),
            catch_up_held_bytes: running().map(|c| c.held_bytes() as u64).sum(),
            links_failed: c.links_failed.load(Ordering::Relaxed),
            queues: state.roles.len() as u64,
            in_sync_backups: in_sync,
            catching_up_backups: catching_up,
        }
    }
}
