//! The hand-off to the journal: what a batch of vhost commands changed in durable state
//! becomes journal jobs, and the sequence number a batch's replies must wait for.

use super::Broker;
use crate::core::{Effects, VHost};
use crate::store::journal::Job;
use crate::store::record::{Record, records_from_ops};

impl Broker {
    /// Hands every vhost's pending durable changes to the journal and waits until everything
    /// submitted so far is as durable as promised (wiring: on disk): what the admin API does
    /// before it answers a change.
    pub async fn persist_all_and_wait(&self) {
        let mut fx = Effects::default();
        for (_, vhost) in self.vhosts() {
            let mut v = vhost.lock();
            self.persist(&mut v, &mut fx);
        }
        let target = self.journal.last_submitted();
        let mut synced = self.journal.synced();
        while *synced.borrow() < target {
            if synced.changed().await.is_err() {
                return;
            }
        }
    }

    /// Hands what a batch of commands changed in durable state to the journal: the durable
    /// wiring if it changed, and the records of durable queues' ops. Call it while holding
    /// the vhost lock, so the journal sees changes in the vhost's order. Returns the
    /// journal sequence number that must be durable before this batch's replies go out,
    /// when there is one (a persistent message was enqueued or durable wiring changed).
    pub fn persist(&self, vhost: &mut VHost, fx: &mut Effects) -> Option<u64> {
        let mut gate = None;
        if vhost.take_wiring_changed() {
            gate = Some(self.journal.submit(Job::Wiring {
                vhost: vhost.name().to_owned(),
                wiring: vhost.durable_wiring(),
            }));
        }
        self.replicate(vhost, fx);
        if std::mem::take(&mut fx.resent_held) {
            // The first copy of a resent publish may still be on its way to the disk or to
            // the backups: its resend is confirmed after everything handed over so far.
            gate = gate.max(Some(self.journal.last_submitted()));
            fx.replica_stamp = fx.replica_stamp.max(Some(self.replicator().issued()));
        }
        if !fx.ops.is_empty() || !fx.page_out.is_empty() || !fx.producers_replaced.is_empty() {
            let replica = only_replicas(vhost, fx);
            let mut records = Vec::new();
            // Each replaced producer table at its place among the ops (B18).
            let mut from = 0;
            for r in fx.producers_replaced.drain(..) {
                let at = r.after_ops.min(fx.ops.len());
                records_from_ops(&fx.ops[from..at], &mut records);
                from = at;
                records.push(Record::Producers {
                    uid: r.uid,
                    highest: r.highest,
                    replace: true,
                });
            }
            records_from_ops(&fx.ops[from..], &mut records);
            fx.ops.clear();
            records.extend(fx.page_out.drain(..).map(|p| Record::Paged {
                uid: p.uid,
                id: p.id,
                message: p.message,
            }));
            if !records.is_empty() {
                let must_sync = records.iter().any(|r| matches!(r, Record::Enqueued { .. }));
                if self.journal.body_bytes_in_flight() > MAX_BODY_BYTES_IN_FLIGHT {
                    // The writer is behind: every body queued for it is still in memory.
                    fx.backlogged = true;
                }
                let seq = self.journal.submit(if replica {
                    Job::Replica(records)
                } else {
                    Job::Records(records)
                });
                if must_sync {
                    gate = Some(seq);
                }
            }
        }
        if !fx.page_released.is_empty() || !fx.queues_released.is_empty() {
            self.journal.submit(Job::Release {
                pages: std::mem::take(&mut fx.page_released),
                queues: std::mem::take(&mut fx.queues_released),
            });
        }
        gate
    }
}

/// Whether every op of the batch changed a replica (a backup applying its primary's stream),
/// so that its records may be synced within `journal.replica_sync_ms` rather than before
/// the backup acknowledges them. A batch that touched a queue this member serves is synced
/// as a primary's: its confirms wait for it.
fn only_replicas(vhost: &VHost, fx: &Effects) -> bool {
    let mut checked: Option<&str> = None;
    fx.ops.iter().all(|op| {
        if checked == Some(&*op.queue) {
            return true;
        }
        checked = Some(&op.queue);
        vhost.is_replica(&op.queue)
    })
}

/// Body bytes waiting for the journal writer above which a connection that hands it more is
/// paced like a publisher to a backlogged queue.
const MAX_BODY_BYTES_IN_FLIGHT: u64 = 16 * 1024 * 1024;
