//! The watcher of one backup's link (one task per backup and vhost): it reads the link's
//! answers — the ledger advances, the catch-ups' windows open, a confirmed catch-up commits
//! the backup in sync — and on a failed or refusing link commits the backup out of sync and
//! starts over on a new link; between answers it moves the link's catch-ups on.

use super::{Link, ReplicationHost, Replicator, State, owed_key};
use crate::core::VHost;
use crate::proxy::forward::ForwardTracker;
use crate::replication::catch_up::{CatchUp, Phase};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// A catch-up whose last frame the backup confirmed: the backup is committed in sync next.
#[derive(Debug)]
struct Confirmed {
    queue: Arc<str>,
    incarnation: u64,
    /// When its image was taken: its duration is measured up to the in-sync commit.
    started: Instant,
}

impl Replicator {
    /// Starts the watcher of `backup`'s link for `vhost` unless one runs.
    pub(super) fn watch_link(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        backup: &str,
        vhost: &str,
    ) {
        let mut state = self.state.lock();
        if let Some(link) = state.links.get_mut(&(backup.to_owned(), vhost.to_owned()))
            && !link.watched
        {
            link.watched = true;
            tokio::spawn(
                self.clone()
                    .watch(host.clone(), backup.to_owned(), vhost.to_owned()),
            );
        }
    }

    /// Follows one backup's link: acknowledgements advance the ledger and open the
    /// catch-ups' windows, confirmed catch-ups commit the backup in sync, a failure commits
    /// it out of sync and catches it up again, and the catch-ups' chunks are built and sent
    /// here, outside the vhost lock.
    async fn watch(self: Arc<Self>, host: Arc<dyn ReplicationHost>, backup: String, vhost: String) {
        let key = (backup.clone(), vhost.clone());
        loop {
            let (tracker, kick) = match self.state.lock().links.get(&key) {
                Some(link) => (link.tracker.clone(), link.kick.clone()),
                None => return,
            };
            let changed = tracker.changed();
            let kicked = kick.notified();
            let (in_sync, broken) = self.take_answers(&key, &tracker);
            for Confirmed {
                queue,
                incarnation,
                started,
            } in in_sync
            {
                let committed = host.commit_sync(&vhost, &queue, incarnation, &backup, true);
                let outcome = committed.await;
                {
                    let mut state = self.state.lock();
                    state
                        .pending
                        .remove(&(vhost.clone(), queue.clone(), backup.clone()));
                    self.settle_forgiven(&mut state, &vhost);
                }
                match outcome {
                    Ok(()) => {
                        self.counters
                            .catch_ups_completed
                            .fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .catch_up_seconds
                            .observe(started.elapsed().as_secs_f64());
                        tracing::info!(%backup, %vhost, %queue, "catch-up done: the backup is in sync");
                    }
                    Err(e) => {
                        tracing::warn!(%backup, %queue, error = %e, "backup caught up, but its in-sync mark was not committed");
                    }
                }
            }
            if broken {
                self.recover(&host, &backup, &vhost).await;
                continue;
            }
            self.pump(&host, &key).await;
            let wake = self.next_wake(&key);
            let far = Instant::now() + std::time::Duration::from_secs(3600);
            let sleep = tokio::time::sleep_until(wake.unwrap_or(far).into());
            tokio::select! {
                () = changed => {}
                () = kicked => {}
                () = sleep => {}
            }
        }
    }

    /// When the watcher of link `key` must look at its catch-ups again at the latest.
    fn next_wake(&self, key: &(String, String)) -> Option<Instant> {
        let state = self.state.lock();
        let link = state.links.get(key)?;
        link.catch_ups.values().map(CatchUp::next_wake).min()
    }

    /// Reads what the link's tracker answered: the ledger advances and the catch-ups'
    /// windows open; returns the catch-ups the backup confirmed and whether the link broke.
    fn take_answers(
        &self,
        key: &(String, String),
        tracker: &ForwardTracker,
    ) -> (Vec<Confirmed>, bool) {
        let status = tracker.status();
        let mut state = self.state.lock();
        let State {
            ledger,
            links,
            pending,
            roles,
            ..
        } = &mut *state;
        let Some(link) = links.get_mut(key) else {
            return (Vec::new(), false);
        };
        let mut images = Vec::new();
        let mut last = None;
        while let Some(s) = link
            .sent
            .front()
            .filter(|s| s.id <= status.answered_through)
        {
            last = Some(s.what.stamp);
            let s = link.sent.pop_front().expect("front exists");
            if let Some(attempt) = s.what.image {
                images.push((s.what.queue, attempt));
            }
        }
        let answered = status.answered_through;
        let refused = answered > 0 && tracker.not_taken(1, answered);
        if refused || status.failure.is_some() {
            link.broken = true;
            // A backup counted only until its mark commits is no longer awaited; one the map
            // counts stays awaited until `recover` commits it out of sync.
            pending.retain(|(v, _, b)| !(*v == key.1 && *b == key.0));
            let counted = roles
                .iter()
                .any(|((v, _), r)| *v == key.1 && r.in_sync.contains(&key.0));
            if !counted {
                ledger.forgive(&owed_key(&key.0, &key.1));
                self.acked.send_replace(ledger.acked_through());
            }
            self.counters.links_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(backup = %key.0, vhost = %key.1, refused, failure = ?status.failure, "replication link to a backup failed: catching it up again");
            return (Vec::new(), true);
        }
        for c in link.catch_ups.values_mut() {
            c.answered(answered);
        }
        // A catch-up's last frame confirmed: done, if that attempt is still the current one
        // (a later attempt's first chunk resets the replica again).
        let mut in_sync = Vec::new();
        for (queue, attempt) in images {
            let done = link
                .catch_ups
                .get(&queue)
                .is_some_and(|c| c.attempt == attempt && c.phase == Phase::Confirming);
            if done && let Some(c) = link.catch_ups.remove(&queue) {
                tracing::info!(backup = %key.0, vhost = %key.1, %queue, attempt, messages = c.messages_total, bytes = c.bytes_sent, stand_ins = c.stand_ins, elapsed_ms = c.started.elapsed().as_millis() as u64, "catch-up confirmed by the backup");
                in_sync.push(Confirmed {
                    queue,
                    incarnation: c.incarnation,
                    started: c.started,
                });
            }
        }
        if let Some(last) = last {
            let through = link.sent.front().map_or(last, |next| next.what.stamp - 1);
            ledger.acked(&owed_key(&key.0, &key.1), through);
            self.acked.send_replace(ledger.acked_through());
        }
        (in_sync, false)
    }

    /// The link to `backup` broke: commit it out of sync wherever it was in sync (confirms
    /// that count on it wait until then), then start over on a new link, every queue from a
    /// new image.
    async fn recover(self: &Arc<Self>, host: &Arc<dyn ReplicationHost>, backup: &str, vhost: &str) {
        let counted: Vec<(Arc<str>, u64)> = {
            let state = self.state.lock();
            state
                .roles
                .iter()
                .filter(|((v, _), r)| v == vhost && r.in_sync.iter().any(|b| b == backup))
                .map(|((_, q), r)| (q.clone(), r.incarnation))
                .collect()
        };
        for (queue, incarnation) in counted {
            // Until this commits, the confirms that need this backup stay held: retry.
            while let Err(e) = host
                .commit_sync(vhost, &queue, incarnation, backup, false)
                .await
            {
                tracing::warn!(backup, %queue, error = %e, "cannot commit the backup out of sync yet; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let me = self.clone();
        let backup = backup.to_owned();
        let vhost_name = vhost.to_owned();
        host.with_vhost(vhost, &mut |v: &mut VHost| {
            let mut state = me.state.lock();
            let key = (backup.clone(), vhost_name.clone());
            let old = state.links.insert(
                key,
                Link {
                    watched: true,
                    ..Link::default()
                },
            );
            let dropped = old.map_or(0, |l| {
                l.catch_ups
                    .values()
                    .filter(|c| !matches!(c.phase, Phase::Abandoned(_)))
                    .count()
            });
            me.counters
                .catch_ups_abandoned
                .fetch_add(dropped as u64, Ordering::Relaxed);
            let queues: Vec<(Arc<str>, u64)> = state
                .roles
                .iter()
                .filter(|((vn, _), r)| *vn == vhost_name && r.backups.contains(&backup))
                .map(|((_, q), r)| (q.clone(), r.incarnation))
                .collect();
            let now = Instant::now();
            for (queue, incarnation) in queues {
                me.start_catch_up(&mut state, v, &backup, &queue, incarnation, now);
            }
        });
    }
}
