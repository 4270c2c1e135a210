//! Catch-ups on the primary, driven by the link's watcher: a catch-up starts from an image
//! taken under the vhost lock, then its chunks are built (paged-out bodies read back from the
//! journal) outside every lock and handed to the link under the vhost lock, windowed by the
//! backup's acknowledgements; abandoned ones start over after their retry delay. The state of
//! one catch-up is [`crate::replication::catch_up::CatchUp`]; this is its I/O.

use super::{Outgoing, ReplicationHost, Replicator, State, encode};
use crate::core::VHost;
use crate::core::message::{DiskBody, Message};
use crate::core::queue::ImageChunk;
use crate::replication::catch_up::{CatchUp, ChunkWork, Phase};
use crate::replication::codec::Frame;
use bytes::Bytes;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Most chunks one pass of a link's watcher builds before it looks at the answers again.
const CHUNKS_PER_PASS: usize = 16;

impl Replicator {
    /// Starts (or starts over) a catch-up of `backup` for `queue` from an image taken now —
    /// refcounted handles, no body copied. Call it under `v`'s lock, so that the image is
    /// the queue at a batch boundary and the ops after it reach [`Self::replicate`] after
    /// this. Returns whether it started (the link's watcher must be running).
    pub(super) fn start_catch_up(
        &self,
        state: &mut State,
        v: &VHost,
        backup: &str,
        queue: &str,
        incarnation: u64,
        now: Instant,
    ) -> bool {
        let Some(image) = v.queue_image(queue) else {
            return false;
        };
        state.attempts += 1;
        let attempt = state.attempts;
        let link = state
            .links
            .entry((backup.to_owned(), v.name().to_owned()))
            .or_default();
        if link.broken {
            // Its watcher starts every catch-up of this backup again on a new link.
            return false;
        }
        tracing::info!(
            backup,
            vhost = v.name(),
            queue,
            attempt,
            messages = image.entries.len(),
            last_seq = image.last_seq,
            "catch-up started: sending the queue's image in chunks"
        );
        let c = CatchUp::new(incarnation, attempt, image, now, &self.limits);
        link.catch_ups.insert(queue.into(), c);
        link.kick.notify_one();
        self.counters
            .catch_ups_started
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Moves the catch-ups of link `key` on: those past their deadline are abandoned, those
    /// abandoned a while ago start over from a new image, and chunks are sent while their
    /// windows have room.
    pub(super) async fn pump(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        key: &(String, String),
    ) {
        let (backup, vhost) = (key.0.as_str(), key.1.as_str());
        let now = Instant::now();
        let due: Vec<(Arc<str>, u64, u64)> = {
            let mut state = self.state.lock();
            let Some(link) = state.links.get_mut(key).filter(|l| !l.broken) else {
                return;
            };
            let mut due = Vec::new();
            for (queue, c) in link.catch_ups.iter_mut() {
                if c.expired(now) {
                    c.abandon("not done in time", now, &self.limits);
                    self.counters
                        .catch_ups_abandoned
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(backup, vhost, %queue, attempt = c.attempt, timeout_ms = self.limits.timeout.as_millis() as u64, messages_sent = c.messages_sent, messages = c.messages_total, "catch-up abandoned: not done within replication_catch_up_timeout_ms; retrying from a new image");
                }
                if c.due_for_retry(now) {
                    // Looked at again after another delay, should this retry not happen
                    // (the vhost is gone).
                    c.retry_at = Some(now + self.limits.retry_delay);
                    due.push((queue.clone(), c.incarnation, c.attempt));
                }
            }
            due
        };
        if !due.is_empty() {
            let me = self.clone();
            host.with_vhost(vhost, &mut |v: &mut VHost| {
                let mut state = me.state.lock();
                let now = Instant::now();
                for (queue, incarnation, attempt) in &due {
                    let wanted = state
                        .roles
                        .get(&(vhost.to_owned(), queue.clone()))
                        .is_some_and(|r| {
                            r.incarnation == *incarnation
                                && r.backups.iter().any(|b| b == backup)
                                && !r.in_sync.iter().any(|b| b == backup)
                        });
                    let Some(link) = state.links.get_mut(key) else {
                        return;
                    };
                    let still_abandoned = link.catch_ups.get(queue).is_some_and(|c| {
                        c.attempt == *attempt && matches!(c.phase, Phase::Abandoned(_))
                    });
                    if !still_abandoned {
                        continue;
                    }
                    link.catch_ups.remove(queue);
                    if wanted {
                        me.start_catch_up(&mut state, v, backup, queue, *incarnation, now);
                    }
                }
            });
        }
        for _ in 0..CHUNKS_PER_PASS {
            let work = {
                let mut state = self.state.lock();
                let Some(link) = state.links.get_mut(key).filter(|l| !l.broken) else {
                    return;
                };
                link.catch_ups.iter_mut().find_map(|(queue, c)| {
                    let w = c.next_chunk(queue, &self.limits)?;
                    Some((queue.clone(), c.incarnation, w))
                })
            };
            let Some((queue, incarnation, work)) = work else {
                return;
            };
            self.send_chunk(host, key, queue, incarnation, work).await;
        }
        // More may be due: look again after the answers.
        if let Some(link) = self.state.lock().links.get(key) {
            link.kick.notify_one();
        }
    }

    /// Builds one chunk of a catch-up — paged-out bodies read back from the journal, the
    /// frame encoded, all outside every lock — and sends it under the vhost lock (so that it
    /// is ordered with the batches' frames on the link). After the last chunk, the ops held
    /// back go out behind it, and the last frame carries the catch-up's mark.
    async fn send_chunk(
        self: &Arc<Self>,
        host: &Arc<dyn ReplicationHost>,
        key: &(String, String),
        queue: Arc<str>,
        incarnation: u64,
        work: ChunkWork,
    ) {
        let (backup, vhost) = (key.0.as_str(), key.1.as_str());
        let ChunkWork {
            attempt,
            mut entries,
            first,
            last,
            last_seq,
            next_id,
            producers,
        } = work;
        let built = async {
            let mut stand_ins = 0;
            let paged: Vec<(usize, DiskBody)> = entries
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.message.body.on_disk().map(|k| (i, k)))
                .collect();
            if !paged.is_empty() {
                let keys: Vec<DiskBody> = paged.iter().map(|(_, k)| *k).collect();
                let reader = host.clone();
                let bodies = tokio::task::spawn_blocking(move || reader.read_paged(&keys))
                    .await
                    .map_err(|e| e.to_string())??;
                for ((i, _), body) in paged.into_iter().zip(bodies) {
                    let m = &entries[i].message;
                    // Gone: the message left the queue after the image, so an op held
                    // back behind the last chunk removes it before the backup counts as
                    // in sync; the backup never serves this stand-in.
                    let resolved = match body {
                        Some(body) => m.with_body(body),
                        None => {
                            stand_ins += 1;
                            stand_in(m)
                        }
                    };
                    entries[i].message = Arc::new(resolved);
                }
            }
            let messages = entries.len();
            let frame = Frame::Image {
                incarnation,
                queue: queue.clone(),
                chunk: ImageChunk {
                    first,
                    last,
                    last_seq,
                    next_id,
                    entries,
                    producers,
                },
            };
            encode(&frame)
                .map(|m| (m, (messages, stand_ins)))
                .map_err(|e| e.to_string())
        };
        let (frame, messages) = match built.await {
            Ok(built) => built,
            Err(e) => {
                let mut state = self.state.lock();
                if let Some(c) = state
                    .links
                    .get_mut(key)
                    .and_then(|l| l.catch_ups.get_mut(&queue))
                    .filter(|c| c.attempt == attempt)
                {
                    c.chunk_failed(Instant::now(), &self.limits);
                    self.counters
                        .catch_ups_abandoned
                        .fetch_add(1, Ordering::Relaxed);
                }
                tracing::error!(backup, vhost, %queue, error = %e, "catch-up abandoned: a chunk of the image could not be built; retrying");
                return;
            }
        };
        let bytes = frame.body_len();
        let me = self.clone();
        let host2 = host.clone();
        host.with_vhost(vhost, &mut |_v: &mut VHost| {
            let mut state = me.state.lock();
            let current = |state: &mut State| {
                state
                    .links
                    .get_mut(key)
                    .filter(|l| !l.broken)
                    .and_then(|l| l.catch_ups.get_mut(&queue))
                    .filter(|c| c.attempt == attempt && c.phase == Phase::Sending)
                    .map(|c| c.held_bytes() == 0)
            };
            // Abandoned or replaced meanwhile: this chunk is not wanted any more.
            let Some(nothing_held) = current(&mut state) else {
                return;
            };
            let after_index = host2.applied_index();
            let mark = |last_frame: bool| (last && last_frame).then_some(attempt);
            let what = Outgoing {
                queue: queue.clone(),
                ops: u32::try_from(messages.0).unwrap_or(u32::MAX),
                stamp: state.ledger.issue([]),
                image: mark(nothing_held),
            };
            let Some(job) = me.frame_job(&mut state, vhost, backup, &frame, what, after_index)
            else {
                return;
            };
            let id = job.ticket.as_ref().map_or(0, |(_, id)| *id);
            let mut jobs = vec![job];
            let held = match state
                .links
                .get_mut(key)
                .and_then(|l| l.catch_ups.get_mut(&queue))
            {
                Some(c) => c.chunk_sent(id, messages, bytes, last),
                None => Vec::new(),
            };
            if last {
                state
                    .pending
                    .insert((vhost.to_owned(), queue.clone(), backup.to_owned()));
            }
            let n = held.len();
            for (i, ops) in held.into_iter().enumerate() {
                let what = Outgoing {
                    queue: queue.clone(),
                    ops: ops.ops,
                    stamp: state.ledger.issue([]),
                    image: mark(i + 1 == n),
                };
                if let Some(job) =
                    me.frame_job(&mut state, vhost, backup, &ops.message, what, after_index)
                {
                    jobs.push(job);
                }
            }
            drop(state);
            me.forwarders.send(vhost, vec![(Arc::from(backup), jobs)]);
        });
    }
}

/// What a catch-up sends for an image entry whose paged-out body is gone from the journal
/// (its message left the queue after the image was taken): an empty, transient message of
/// the same priority, which the op that removed the original removes from the backup too.
fn stand_in(m: &Message) -> Message {
    Message::authored(
        "".into(),
        "".into(),
        crate::amqp::Properties::default().with_priority(m.priority),
        Bytes::new(),
    )
}
