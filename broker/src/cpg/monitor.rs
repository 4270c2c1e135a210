//! The background duty of every member, once a heartbeat: renew the quorum lease (followers
//! ping the leader), publish the quorum watch, and on the leader detect and remove failed or
//! hopelessly slow members.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use openraft::{ChangeMembers, ServerState};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::error::StopReason;
use super::lease::Lease;
use super::node::{Cpg, write_timeout};
use super::types::{Command, MemberId};
use super::wire::{Envelope, Request, Response};

impl Cpg {
    /// Runs lease renewal, quorum reporting and (on the leader) failure detection every
    /// heartbeat, until the member is shut down or, after stopping for a reason of its own,
    /// has been removed from the voters.
    pub(crate) fn spawn_monitor(&self) {
        let weak = Arc::downgrade(&self.inner);
        let task = tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            let period = Duration::from_millis(inner.config.heartbeat_ms);
            drop(inner);
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut monitor = Monitor::default();
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                let cpg = Cpg { inner };
                #[cfg(test)]
                if cpg.inner.paused.load(Ordering::Acquire) {
                    continue;
                }
                match cpg.stop_reason() {
                    Some(StopReason::Shutdown) => return,
                    Some(_) if cpg.inner.durable || cpg.may_retire(&monitor) => {
                        // Evicted, overrun or fell behind, and no longer a voter (or, with a
                        // disk, at once: its vote and log are saved, and its restart is the
                        // same voter — an evicted leader steps down this way): stop consensus
                        // too.
                        cpg.inner
                            .quorum_tx
                            .send_if_modified(|q| std::mem::replace(q, false));
                        cpg.inner.retired.store(true, Ordering::Release);
                        let _ = cpg.inner.raft.shutdown().await;
                        return;
                    }
                    _ => cpg.monitor_tick(&mut monitor),
                }
            }
        });
        self.inner.tasks.lock().push(task);
    }

    /// Whether a stopped member may stop voting: the cluster told it it was removed, or its
    /// own committed membership no longer lists it.
    fn may_retire(&self, monitor: &Monitor) -> bool {
        if monitor.removed.load(Ordering::Acquire) {
            return true;
        }
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        let committed =
            m.membership_config.log_id().map(|l| l.index) <= m.last_applied.map(|l| l.index);
        let voter = m
            .membership_config
            .membership()
            .voter_ids()
            .any(|v| v == self.inner.id);
        committed && !voter
    }

    fn monitor_tick(&self, monitor: &mut Monitor) {
        let inner = &self.inner;
        let now = Instant::now();
        let stopped = self.stop_reason().is_some();
        let (state, term, membership_index, leader, voters, joint, settled, addrs, lag, applied) = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let voters: BTreeSet<MemberId> = membership.voter_ids().collect();
            let joint = membership.get_joint_config().len() > 1;
            // Committed and not joint: the voters every earlier leader's majority met.
            let settled = !joint
                && m.membership_config.log_id().map(|l| l.index) <= m.last_applied.map(|l| l.index);
            let addrs: BTreeMap<MemberId, String> = membership
                .nodes()
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect();
            let last = m.last_log_index.unwrap_or(0);
            let lag: BTreeMap<MemberId, u64> = m
                .replication
                .as_ref()
                .map(|r| {
                    r.iter()
                        .map(|(id, matched)| {
                            (*id, last.saturating_sub(matched.map_or(0, |l| l.index)))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let membership_index = m.membership_config.log_id().map_or(0, |l| l.index);
            (
                m.state,
                m.current_term,
                membership_index,
                m.current_leader,
                voters,
                joint,
                settled,
                addrs,
                lag,
                m.last_applied.map_or(0, |l| l.index),
            )
        };
        let has_quorum = if state == ServerState::Leader {
            let failed = inner.failed.lock().clone();
            let mut lease = inner.lease.lock();
            lease.leading(term);
            // This leader's own report: when it last acknowledged an earlier term.
            let own = lease.acks.last_below(term, now);
            let own_ms = u64::try_from(now.duration_since(own).as_millis()).unwrap_or(u64::MAX);
            lease.reported(inner.id, term, own_ms, now);
            lease.removals_applied(&failed);
            if monitor.confirm.as_ref().is_none_or(JoinHandle::is_finished) {
                monitor.confirm = Some(self.spawn_confirm(term));
            }
            let q = lease.deadline_at(applied).is_some_and(|d| now < d);
            // Only a leader with quorum declares failures or removes voters.
            if q {
                let suspects = lease.suspects(
                    now,
                    inner.id,
                    &voters,
                    settled,
                    &lag,
                    inner.config.max_lag_entries,
                );
                let fail: BTreeSet<MemberId> = suspects
                    .iter()
                    .filter(|id| !failed.contains(id) && !lease.being_removed().contains(id))
                    .copied()
                    .collect();
                if !fail.is_empty() && monitor.fail.as_ref().is_none_or(JoinHandle::is_finished) {
                    lease.removing(&fail);
                    tracing::warn!(member = inner.id, ?fail, "declaring CPG members failed");
                    let raft = inner.raft.clone();
                    let lease = Arc::clone(&inner.lease);
                    let timeout = write_timeout(&inner.config);
                    let cmd = Command::Fail {
                        members: fail.iter().copied().collect(),
                    };
                    monitor.fail = Some(tokio::spawn(async move {
                        // Not committed in time: proposed again on a later tick, and until
                        // this term ends or the applied set shows it, the members stay denied
                        // a lease (the entry may still commit).
                        if let Ok(Ok(_)) =
                            tokio::time::timeout(timeout, raft.client_write(cmd)).await
                        {
                            lease.lock().removal_done(term, &fail);
                        }
                    }));
                }
                // With a disk, a failed voter comes back as the same voter: removing it would
                // only make its return a membership change (found by the simulation: a
                // removal, the restart's re-admission and another crash wedged a joint
                // configuration). A member gone for good is the operator's to remove.
                if !inner.durable
                    && let Some(gone) = removable(inner.id, &voters, joint, &failed, &lease, now)
                    && monitor.removal.as_ref().is_none_or(JoinHandle::is_finished)
                {
                    tracing::warn!(member = inner.id, gone, "removing a failed CPG voter");
                    let raft = inner.raft.clone();
                    let timeout = write_timeout(&inner.config);
                    monitor.removal = Some(tokio::spawn(async move {
                        let change = raft.change_membership(
                            ChangeMembers::RemoveVoters(BTreeSet::from([gone])),
                            false,
                        );
                        // A failed removal is retried on a later tick.
                        let _ = tokio::time::timeout(timeout, change).await;
                    }));
                }
            }
            q
        } else {
            let mut lease = inner.lease.lock();
            lease.following();
            let q = lease.deadline_at(applied).is_some_and(|d| now < d);
            drop(lease);
            if monitor.ping.as_ref().is_none_or(JoinHandle::is_finished) {
                let target = leader
                    .filter(|l| *l != inner.id)
                    .and_then(|l| addrs.get(&l).cloned())
                    .or_else(|| monitor.hint.lock().take())
                    .or_else(|| {
                        // With no configuration yet (admitted, then cut off before it got a
                        // single entry) the seeds are the only way to learn its fate.
                        let others: Vec<&String> = addrs
                            .iter()
                            .filter(|(id, _)| **id != inner.id)
                            .map(|(_, a)| a)
                            .chain(inner.config.seeds.iter().filter(|_| addrs.len() <= 1))
                            .collect();
                        monitor.next_peer = monitor.next_peer.wrapping_add(1);
                        others
                            .get(monitor.next_peer % others.len().max(1))
                            .map(|a| (*a).clone())
                    });
                if let Some(addr) = target {
                    monitor.ping = Some(self.spawn_ping(
                        addr,
                        term,
                        membership_index,
                        Arc::clone(&monitor.hint),
                        Arc::clone(&monitor.removed),
                    ));
                }
            }
            q
        };
        // A stopped member serves nothing that depends on agreement.
        let has_quorum = has_quorum && !stopped && self.started().is_some();
        inner.quorum_tx.send_if_modified(|q| {
            if *q == has_quorum {
                return false;
            }
            *q = has_quorum;
            true
        });
    }

    /// Renews the leader's lease: one round of heartbeats that a majority must acknowledge
    /// (openraft's read-index check), the lease counted from when it was sent. Its own
    /// measurement, rather than openraft's `millis_since_quorum_ack`, which is a report of
    /// the past: after a pause it would describe acknowledgements from before the pause.
    fn spawn_confirm(&self, term: u64) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        let raft = self.inner.raft.clone();
        let timeout = Duration::from_millis(self.inner.config.rpc_timeout_ms);
        tokio::spawn(async move {
            let sent_at = Instant::now();
            let confirmed = tokio::time::timeout(timeout, raft.get_read_log_id()).await;
            if let Ok(Ok((read, _))) = confirmed
                && let Some(inner) = weak.upgrade()
            {
                let read_index = read.map_or(0, |l| l.index);
                inner
                    .lease
                    .lock()
                    .leader_confirmed(term, sent_at, read_index);
            }
        })
    }

    /// Pings the leader at `addr`: renews this member's lease, proves it alive, and reports
    /// when it last acknowledged a term below its own `term` (a new leader of `term` counts
    /// the failure clocks of silent members from there, see [`Lease::suspects`]).
    fn spawn_ping(
        &self,
        addr: String,
        term: u64,
        known_membership_index: u64,
        hint: Arc<Mutex<Option<String>>>,
        removed: Arc<AtomicBool>,
    ) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        let transport = Arc::clone(&self.inner.transport);
        let id = self.inner.id;
        let timeout = Duration::from_millis(self.inner.config.rpc_timeout_ms);
        tokio::spawn(async move {
            let sent_at = Instant::now();
            let Some(inner) = weak.upgrade() else { return };
            let older = inner.lease.lock().acks.last_below(term, sent_at);
            drop(inner);
            let env = Envelope {
                to: None,
                req: Request::Ping {
                    from: id,
                    term,
                    since_older_ms: u64::try_from(sent_at.duration_since(older).as_millis())
                        .unwrap_or(u64::MAX),
                },
            };
            let resp = transport.call(&addr, env, timeout).await;
            let Some(inner) = weak.upgrade() else { return };
            match resp {
                Ok(Response::Pong {
                    membership_index,
                    member,
                    granted_ms,
                    committed,
                }) => {
                    inner.lease.lock().granted(sent_at, granted_ms, committed);
                    // A member restarted on its data after it left for good (`Cpg::retire`)
                    // is not a voter when it comes back: until its incarnation starts, its
                    // start admits it again (`rejoin_once`), and being told it is no member
                    // is no eviction. A new member is evicted as before (a start that may
                    // never come would leave it waiting for good).
                    let readmitting = inner.restarted
                        && Cpg {
                            inner: Arc::clone(&inner),
                        }
                        .started()
                        .is_none();
                    if !member && membership_index > known_membership_index && !readmitting {
                        removed.store(true, Ordering::Release);
                        Cpg { inner }.set_stop(StopReason::Evicted);
                    }
                }
                Ok(Response::NotLeader { leader }) => *hint.lock() = leader,
                Ok(_) | Err(_) => {}
            }
        })
    }
}

/// What the monitor keeps between ticks.
#[derive(Default)]
struct Monitor {
    confirm: Option<JoinHandle<()>>,
    fail: Option<JoinHandle<()>>,
    removal: Option<JoinHandle<()>>,
    removed: Arc<AtomicBool>,
    ping: Option<JoinHandle<()>>,
    hint: Arc<Mutex<Option<String>>>,
    next_peer: usize,
}

/// The failed voter to remove now, if any. Removing a voter that is in fact alive (cut off,
/// or evicted but still voting) from an *odd* voter set can leave a configuration whose
/// majority needs a member that crashed just before (3 voters, one cut off and removed, one
/// crashed: the remaining pair needs the crashed one, seed 171). From an even set it cannot:
/// if a majority of the old set is alive, a majority of the new one is too, whoever is
/// removed. So a failed voter is removed only from an even set of at least four (in a
/// three-member cluster: once its replacement has joined), one at a time, outside a joint
/// change, and only while every voter that stays was heard lately.
fn removable(
    leader: MemberId,
    voters: &BTreeSet<MemberId>,
    joint: bool,
    failed: &BTreeSet<MemberId>,
    lease: &Lease,
    now: Instant,
) -> Option<MemberId> {
    if joint || voters.len() < 4 || !voters.len().is_multiple_of(2) {
        return None;
    }
    let candidates: BTreeSet<MemberId> = failed
        .iter()
        .filter(|id| **id != leader && voters.contains(id))
        .copied()
        .collect();
    let gone = lease.stalest(&candidates)?;
    lease
        .all_fresh(now, leader, voters.iter().filter(|id| **id != gone))
        .then_some(gone)
}
