//! What the replicator has done and where it stands, for `/metrics`: running totals kept as
//! atomics (bumped once per frame or per catch-up event, never under a new lock), and gauges
//! computed at scrape time from the state the replicator keeps anyway.

use super::{Replicator, State};
use crate::replication::catch_up::Phase;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Running totals for `/metrics`.
#[derive(Debug)]
pub(super) struct Counters {
    pub(super) frames: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) catch_ups_started: AtomicU64,
    pub(super) catch_ups_completed: AtomicU64,
    pub(super) catch_ups_abandoned: AtomicU64,
    pub(super) links_failed: AtomicU64,
    /// Seconds from a completed catch-up's image to its in-sync commit (one observation per
    /// catch-up counted in `catch_ups_completed`).
    pub(super) catch_up_seconds: Histogram,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            frames: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            catch_ups_started: AtomicU64::new(0),
            catch_ups_completed: AtomicU64::new(0),
            catch_ups_abandoned: AtomicU64::new(0),
            links_failed: AtomicU64::new(0),
            // 10 ms .. ~164 s: an empty queue's image to one near the default 2 min limit.
            catch_up_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
        }
    }
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

/// One replicated queue this member is primary of, as the per-queue series show it.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueReplication {
    /// Its vhost.
    pub vhost: String,
    /// Its name.
    pub queue: Arc<str>,
    /// Backups the cluster map gives it.
    pub backups: u64,
    /// Of those, the ones in sync: fewer than `backups` means a failover now could lose
    /// less redundancy than configured, or (at zero) find no backup to elect.
    pub in_sync: u64,
    /// Each backup, in ring order.
    pub per_backup: Vec<BackupReplication>,
}

/// One backup of one queue, on its primary.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupReplication {
    /// The backup's node id.
    pub backup: String,
    /// Queue ops sent to it and not yet acknowledged (an image chunk counts its messages).
    pub lag_ops: u64,
    /// Their encoded bytes.
    pub lag_bytes: u64,
    /// Its catch-up of the queue, while one is under way.
    pub catch_up: Option<CatchUpProgress>,
}

/// How far a catch-up under way has come.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CatchUpProgress {
    /// Messages in its image.
    pub messages: u64,
    /// Of those, sent so far.
    pub messages_sent: u64,
    /// Since its image was taken.
    pub seconds: f64,
}

impl Replicator {
    /// Replication of each queue this member is primary of, for the first `max_queues` (by
    /// vhost and name, so that the set is stable between scrapes). Computed here from the
    /// frames the links have in flight and the catch-ups under way: the replicate path keeps
    /// nothing per queue for it.
    pub fn queue_stats(&self, max_queues: usize) -> Vec<QueueReplication> {
        queue_stats_of(&self.state.lock(), max_queues, Instant::now())
    }

    /// Distribution of completed catch-ups' durations, image to in-sync commit.
    pub fn catch_up_seconds(&self) -> Histogram {
        self.counters.catch_up_seconds.clone()
    }

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

/// [`Replicator::queue_stats`] of `state` at `now`.
fn queue_stats_of(state: &State, max_queues: usize, now: Instant) -> Vec<QueueReplication> {
    // What each link has in flight, by (backup, vhost, queue): one pass over the frames.
    let mut lag: HashMap<(&str, &str, &str), (u64, u64)> = HashMap::new();
    for ((backup, vhost), link) in &state.links {
        for s in &link.sent {
            let e = lag
                .entry((backup.as_str(), vhost.as_str(), &*s.what.queue))
                .or_default();
            e.0 += u64::from(s.what.ops);
            e.1 += s.bytes;
        }
    }
    let mut keys: Vec<&(String, Arc<str>)> = state.roles.keys().collect();
    keys.sort();
    keys.truncate(max_queues);
    keys.into_iter()
        .map(|key @ (vhost, queue)| {
            let roles = &state.roles[key];
            let per_backup = roles
                .backups
                .iter()
                .map(|backup| {
                    let (lag_ops, lag_bytes) = lag
                        .get(&(backup.as_str(), vhost.as_str(), &**queue))
                        .copied()
                        .unwrap_or_default();
                    let catch_up = state
                        .links
                        .get(&(backup.clone(), vhost.clone()))
                        .and_then(|l| l.catch_ups.get(queue))
                        .filter(|c| !matches!(c.phase, Phase::Abandoned(_)))
                        .map(|c| CatchUpProgress {
                            messages: c.messages_total,
                            messages_sent: c.messages_sent,
                            seconds: now.saturating_duration_since(c.started).as_secs_f64(),
                        });
                    BackupReplication {
                        backup: backup.clone(),
                        lag_ops,
                        lag_bytes,
                        catch_up,
                    }
                })
                .collect();
            QueueReplication {
                vhost: vhost.clone(),
                queue: queue.clone(),
                backups: roles.backups.len() as u64,
                in_sync: roles.in_sync.len() as u64,
                per_backup,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::{Link, Outgoing, ReplicaSet, Sent};
    use super::*;
    use crate::amqp::Properties;
    use crate::core::message::Message;
    use crate::core::queue::{ImageEntry, QueueImage};
    use crate::replication::catch_up::{CatchUp, CatchUpLimits};
    use std::time::Duration;

    fn sent(id: u64, queue: &str, ops: u32, bytes: u64) -> Sent {
        Sent {
            id,
            bytes,
            what: Outgoing {
                queue: queue.into(),
                ops,
                stamp: id,
                image: None,
            },
        }
    }

    fn image(messages: u64) -> QueueImage {
        QueueImage {
            producers: Vec::new(),
            last_seq: 10,
            next_id: messages + 1,
            entries: (1..=messages)
                .map(|id| ImageEntry {
                    id,
                    message: Arc::new(Message::authored(
                        "".into(),
                        "q".into(),
                        Properties::default(),
                        bytes::Bytes::from_static(b"m"),
                    )),
                    expires_at_ms: None,
                    redelivered: false,
                    unacked: false,
                })
                .collect(),
        }
    }

    fn roles(backups: &[&str], in_sync: &[&str]) -> ReplicaSet {
        ReplicaSet {
            incarnation: 1,
            backups: backups.iter().map(|b| (*b).to_owned()).collect(),
            in_sync: in_sync.iter().map(|b| (*b).to_owned()).collect(),
        }
    }

    #[test]
    fn per_queue_replication_sums_each_backups_unanswered_frames_and_shows_its_catch_up() {
        let start = Instant::now();
        let mut state = State::default();
        state
            .roles
            .insert(("/".into(), "q".into()), roles(&["b1", "b2"], &["b1"]));
        state
            .roles
            .insert(("/".into(), "r".into()), roles(&["b1"], &["b1"]));
        let mut b1 = Link::default();
        b1.sent.extend([
            sent(1, "q", 3, 100),
            sent(2, "r", 1, 10),
            sent(3, "q", 2, 50),
        ]);
        state.links.insert(("b1".into(), "/".into()), b1);
        let mut b2 = Link::default();
        b2.sent.push_back(sent(1, "q", 2, 2_000));
        let mut c = CatchUp::new(1, 1, image(5), start, &CatchUpLimits::default());
        c.messages_sent = 2;
        b2.catch_ups.insert("q".into(), c);
        state.links.insert(("b2".into(), "/".into()), b2);

        let now = start + Duration::from_secs(3);
        let stats = queue_stats_of(&state, 10, now);
        assert_eq!(stats.len(), 2);
        let q = &stats[0];
        assert_eq!((&*q.queue, q.backups, q.in_sync), ("q", 2, 1));
        assert_eq!(
            q.per_backup,
            vec![
                BackupReplication {
                    backup: "b1".into(),
                    lag_ops: 5,
                    lag_bytes: 150,
                    catch_up: None,
                },
                BackupReplication {
                    backup: "b2".into(),
                    lag_ops: 2,
                    lag_bytes: 2_000,
                    catch_up: Some(CatchUpProgress {
                        messages: 5,
                        messages_sent: 2,
                        seconds: 3.0,
                    }),
                },
            ]
        );
        let r = &stats[1];
        assert_eq!((&*r.queue, r.backups, r.in_sync), ("r", 1, 1));
        assert_eq!(
            (r.per_backup[0].lag_ops, r.per_backup[0].lag_bytes),
            (1, 10)
        );

        assert_eq!(
            queue_stats_of(&state, 1, now).len(),
            1,
            "at most max_queues queues"
        );
        state.links.clear();
        let idle = queue_stats_of(&state, 10, now);
        assert!(
            idle.iter()
                .flat_map(|q| &q.per_backup)
                .all(|b| b.lag_ops == 0 && b.lag_bytes == 0 && b.catch_up.is_none()),
            "a backup with nothing in flight lags by nothing"
        );
    }
}
