//! The end of every batch of vhost commands: bodies paged out to the journal are read back,
//! effects for other connections go to their mailboxes, durable changes go to the journal —
//! in that order, under the vhost lock that produced them.

use super::Broker;
use crate::clock::now_ms;
use crate::core::{DiskBody, Effects, Message, VHost};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Broker {
    /// Everything a batch of commands leaves to do, in the order that keeps it correct; call
    /// it while still holding the vhost lock. Bodies only on disk are read back first (dead
    /// letters, then deliveries), while the journal still holds them: this batch's removals
    /// reach the journal only after, in [`Broker::persist`]. Then effects for other
    /// connections go to their outboxes ([`Broker::route_effects`]). Returns the journal
    /// sequence number this batch's replies wait for, as `persist` does.
    pub fn finish_batch(&self, own: u64, vhost: &mut VHost, fx: &mut Effects) -> Option<u64> {
        self.resolve_paged(vhost, fx);
        self.forward(vhost.name(), fx, None);
        self.retire(vhost.name(), fx);
        self.route_effects(own, fx);
        self.persist(vhost, fx)
    }

    /// Reads back the bodies of this batch's paged dead letters (and re-runs their
    /// dead-lettering, which may page out and drop more) and of its deliveries.
    fn resolve_paged(&self, vhost: &mut VHost, fx: &mut Effects) {
        self.resolve_paged_dead_letters(vhost, fx);
        let (at, keys): (Vec<usize>, Vec<DiskBody>) = fx
            .deliveries
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.message.body.on_disk().map(|k| (i, k)))
            .unzip();
        if keys.is_empty() {
            return;
        }
        for (i, body) in at.into_iter().zip(self.read_bodies(&keys)) {
            let d = &mut fx.deliveries[i];
            d.message = Arc::new(d.message.with_body(body));
        }
    }

    /// Reads back the bodies of this batch's paged dead letters and re-runs their
    /// dead-lettering (which may page out and drop more). A connection calls it before it
    /// forwards its batch, so that these copies' forwards are tracked like the others'.
    pub fn resolve_paged_dead_letters(&self, vhost: &mut VHost, fx: &mut Effects) {
        for _ in 0..MAX_DEAD_LETTER_ROUNDS {
            if fx.paged_dead_letters.is_empty() {
                break;
            }
            let mut dead = std::mem::take(&mut fx.paged_dead_letters);
            let (at, keys): (Vec<usize>, Vec<DiskBody>) = dead
                .iter()
                .enumerate()
                .filter_map(|(i, d)| d.message.body.on_disk().map(|k| (i, k)))
                .unzip();
            for (i, body) in at.into_iter().zip(self.read_bodies(&keys)) {
                let d = &mut dead[i];
                d.message = Arc::new(d.message.with_body(body));
            }
            vhost.dead_letter_resolved(dead, now_ms(), fx);
        }
        if !fx.paged_dead_letters.is_empty() {
            tracing::warn!(
                vhost = %vhost.name(),
                dropped = fx.paged_dead_letters.len(),
                "dead-letter chain of paged messages too long; dropped the rest"
            );
            fx.paged_dead_letters.clear();
        }
    }

    /// Hands this batch's messages for queues owned by other members to those members
    /// ([`Effects::forwards`]); with a tracker, each forward is numbered in it so that the
    /// publisher's confirms wait for it. Forwards of dead letters and expiries go without
    /// one (the at-most-once of dead-lettering, as on one broker).
    pub fn forward(
        &self,
        vhost: &str,
        fx: &mut Effects,
        tracker: Option<&Arc<crate::proxy::forward::ForwardTracker>>,
    ) {
        if fx.forwards.is_empty() {
            return;
        }
        let proxies = self.proxies();
        let mut batches: Vec<(Arc<str>, Vec<crate::proxy::forward::Job>)> = Vec::new();
        for f in fx.forwards.drain(..) {
            if f.lost {
                // Never sent: a connection that kept it waits for the election through
                // its failure (a session's publish, sent again by its client).
                if let Some(t) = tracker {
                    let ticket = t.issue();
                    t.settle(
                        ticket,
                        crate::proxy::forward::ForwardOutcome::Failed(format!(
                            "the queue's primary {} is not a live member",
                            f.primary
                        )),
                    );
                }
                continue;
            }
            let job = crate::proxy::forward::Job {
                exchange: f.exchange,
                routing_key: f.routing_key,
                message: self.resolve_message(f.message),
                ticket: tracker.map(|t| (t.clone(), t.issue())),
                after_index: proxies.applied.index(),
                origin: f.origin,
            };
            match batches.iter_mut().find(|(p, _)| *p == f.primary) {
                Some((_, jobs)) => jobs.push(job),
                None => batches.push((f.primary, vec![job])),
            }
        }
        proxies.forwarders.send(vhost, batches);
    }

    /// Commits the deletion of the shared queues this batch retired (auto-delete, `x-expires`)
    /// through the cluster, once per queue at a time: the tick names them again if the op
    /// could not be committed.
    fn retire(&self, vhost: &str, fx: &mut Effects) {
        self.retire_awaited(vhost, fx, None);
    }

    /// [`Self::retire`] for a connection whose batch retired the queues (its consumer's
    /// cancel ended an auto-delete queue): each deletion counts as one of the connection's
    /// forwards in `tracker`, answered once the delete is committed and applied here (or
    /// could not be), so the batch's replies — the cancel-ok — leave after the queue is gone,
    /// as on one broker.
    pub fn retire_awaited(
        &self,
        vhost: &str,
        fx: &mut Effects,
        tracker: Option<&Arc<crate::proxy::forward::ForwardTracker>>,
    ) {
        if fx.retire.is_empty() {
            return;
        }
        let Some(cluster) = self.cluster().cloned() else {
            fx.retire.clear();
            return;
        };
        for name in fx.retire.drain(..) {
            let key = (vhost.to_owned(), name.to_string());
            if !self.retiring.lock().insert(key.clone()) {
                continue;
            }
            let ticket = tracker.map(|t| (t.clone(), t.issue()));
            tracing::info!(vhost, queue = %name, "retiring the queue (auto-delete or x-expires) through the cluster");
            let committed = cluster.submit(
                vhost,
                crate::core::WiringOp::DeleteQueue {
                    name: name.to_string(),
                    if_unused: false,
                    if_empty: false,
                },
            );
            let retiring = self.retiring.clone();
            tokio::spawn(async move {
                let _ = committed.await;
                retiring.lock().remove(&key);
                if let Some((tracker, id)) = ticket {
                    // Not taken (no majority): the tick retires it again; the connection
                    // goes on either way.
                    tracker.settle(id, crate::proxy::forward::ForwardOutcome::Confirmed);
                }
            });
        }
    }

    /// `message` with its body in memory, read back from the journal when it was paged out
    /// (basic.get). Call it under the vhost lock that produced it, like [`Broker::finish_batch`].
    pub fn resolve_message(&self, message: Arc<Message>) -> Arc<Message> {
        match message.body.on_disk() {
            None => message,
            Some(key) => {
                let body = self.read_bodies(&[key]).pop().expect("one body per key");
                Arc::new(message.with_body(body))
            }
        }
    }

    /// Reads bodies back from the journal. A body the journal cannot give back is a broken
    /// promise of the store, like a failed write: the broker stops loudly rather than
    /// deliver something else or nothing. When the record is damaged or missing it first
    /// deletes the snapshot, so that the restart scans the journal and drops the damaged
    /// record (and what follows it in its segment) instead of failing on it again.
    fn read_bodies(&self, keys: &[DiskBody]) -> Vec<bytes::Bytes> {
        let seq = self.journal.last_submitted();
        match crate::store::paging::read_bodies(self.journal.index(), keys, seq) {
            Ok(bodies) => {
                self.journal
                    .stats
                    .bodies_read
                    .fetch_add(keys.len() as u64, Ordering::Relaxed);
                bodies
            }
            Err(e) => {
                tracing::error!(error = %e, "reading a paged-out body failed; stopping the broker");
                if !matches!(e, crate::store::paging::ReadError::Io { .. })
                    && let Err(e) = crate::store::snapshot::discard(&self.data_dir.path)
                {
                    tracing::error!(error = %e, "could not delete the snapshot");
                }
                std::process::exit(70);
            }
        }
    }

    /// Reads paged-out bodies back for a catch-up's image, outside the vhost lock: `None`
    /// for a body whose record is gone (its message left the queue since the image was
    /// taken). Unlike a delivery's read this is no broken promise, so it stops nothing.
    pub fn read_paged_for_image(
        &self,
        keys: &[DiskBody],
    ) -> Result<Vec<Option<bytes::Bytes>>, String> {
        let seq = self.journal.last_submitted();
        let bodies = crate::store::paging::read_present(self.journal.index(), keys, seq)
            .map_err(|e| e.to_string())?;
        self.journal
            .stats
            .bodies_read
            .fetch_add(bodies.iter().flatten().count() as u64, Ordering::Relaxed);
        Ok(bodies)
    }

    /// Hands effects meant for other connections to their mailboxes. Call it while still
    /// holding the vhost lock that produced them (see [`Outbox`]). Items for `own` are left
    /// in `fx` for the caller to write directly.
    pub fn route_effects(&self, own: u64, fx: &mut Effects) {
        if fx.deliveries.iter().all(|d| d.channel.conn == own)
            && fx.cancelled.iter().all(|c| c.channel.conn == own)
        {
            return;
        }
        let outboxes = self.outboxes.read();
        // One pass: keep this connection's deliveries in order, group the others by target
        // (a batch reaches few connections, so a short list beats a map).
        let mut groups: Vec<(u64, Vec<crate::core::Delivery>)> = Vec::new();
        let mut mine = Vec::with_capacity(fx.deliveries.len());
        for d in fx.deliveries.drain(..) {
            let conn = d.channel.conn;
            if conn == own {
                mine.push(d);
            } else if let Some((_, group)) = groups.iter_mut().find(|(c, _)| *c == conn) {
                group.push(d);
            } else {
                groups.push((conn, vec![d]));
            }
        }
        fx.deliveries = mine;
        for (conn, batch) in groups {
            if let Some(outbox) = outboxes.get(&conn) {
                outbox.push(|p| p.deliveries.extend(batch));
            }
        }
        let (mine, others): (Vec<_>, Vec<_>) =
            fx.cancelled.drain(..).partition(|c| c.channel.conn == own);
        fx.cancelled = mine;
        for c in others {
            if let Some(outbox) = outboxes.get(&c.channel.conn) {
                outbox.push(|p| p.cancelled.push(c));
            }
        }
    }
}

/// Most rounds of reading paged dead letters back per batch: a dead letter whose enqueue
/// pushes out another paged message (drop-head) makes another round.
const MAX_DEAD_LETTER_ROUNDS: usize = 64;
