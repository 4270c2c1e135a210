//! The background duty of every member, once a heartbeat: renew the quorum lease (followers
//! ping the leader), publish the quorum watch, and on the leader detect and remove failed or
//! hopelessly slow members.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::{ChangeMembers, ServerState};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::error::StopReason;
use super::node::{Cpg, write_timeout};
use super::types::MemberId;
use super::wire::{Envelope, Request, Response};

impl Cpg {
    /// Runs lease renewal, quorum reporting and (on the leader) failure detection every
    /// heartbeat, until the member stops.
    pub(crate) fn spawn_monitor(&self) {
        let weak = Arc::downgrade(&self.inner);
        let task = tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            let period = Duration::from_millis(inner.config.heartbeat_ms);
            let mut stop = inner.stop.subscribe();
            drop(inner);
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut monitor = Monitor::default();
            loop {
                tokio::select! {
                    biased;
                    _ = stop.changed() => break,
                    _ = tick.tick() => {}
                }
                let Some(inner) = weak.upgrade() else { return };
                Cpg { inner }.monitor_tick(&mut monitor);
            }
            if let Some(inner) = weak.upgrade() {
                // Stopped for a reason of its own (evicted, overrun): stop consensus too.
                let _ = inner.raft.shutdown().await;
            }
        });
        self.inner.tasks.lock().push(task);
    }

    fn monitor_tick(&self, monitor: &mut Monitor) {
        let inner = &self.inner;
        let now = Instant::now();
        let (state, term, membership_index, leader, voters, addrs, quorum_ack_ms, lag) = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let voters: BTreeSet<MemberId> = membership.voter_ids().collect();
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
                addrs,
                m.millis_since_quorum_ack,
                lag,
            )
        };
        let has_quorum = if state == ServerState::Leader {
            let mut lease = inner.lease.lock();
            lease.leading(term);
            lease.leader_acked(now, quorum_ack_ms, inner.config.heartbeat_ms);
            let q = lease.leader_has_quorum(now);
            // Only a leader with quorum removes members: a cut-off leader proposing to remove
            // the majority would leave a joint configuration nobody can ever commit.
            let failed = if q {
                lease.failed(now, inner.id, &voters, &lag, inner.config.max_lag_entries)
            } else {
                BTreeSet::new()
            };
            let propose =
                !failed.is_empty() && monitor.removal.as_ref().is_none_or(JoinHandle::is_finished);
            if propose {
                lease.removing(&failed);
            }
            drop(lease);
            if propose {
                tracing::warn!(member = inner.id, ?failed, "removing failed CPG members");
                let raft = inner.raft.clone();
                let timeout = write_timeout(&inner.config);
                monitor.removal = Some(tokio::spawn(async move {
                    let change = raft.change_membership(ChangeMembers::RemoveVoters(failed), false);
                    // A failed removal is retried on a later tick.
                    let _ = tokio::time::timeout(timeout, change).await;
                }));
            }
            q
        } else {
            let mut lease = inner.lease.lock();
            lease.following();
            let q = lease.follower_has_quorum(now);
            drop(lease);
            if monitor.ping.as_ref().is_none_or(JoinHandle::is_finished) {
                let target = leader
                    .filter(|l| *l != inner.id)
                    .and_then(|l| addrs.get(&l).cloned())
                    .or_else(|| monitor.hint.lock().take())
                    .or_else(|| {
                        let others: Vec<&String> = addrs
                            .iter()
                            .filter(|(id, _)| **id != inner.id)
                            .map(|(_, a)| a)
                            .collect();
                        monitor.next_peer = monitor.next_peer.wrapping_add(1);
                        others
                            .get(monitor.next_peer % others.len().max(1))
                            .map(|a| (*a).clone())
                    });
                if let Some(addr) = target {
                    monitor.ping =
                        Some(self.spawn_ping(addr, membership_index, Arc::clone(&monitor.hint)));
                }
            }
            q
        };
        inner.quorum_tx.send_if_modified(|q| {
            if *q == has_quorum {
                return false;
            }
            *q = has_quorum;
            true
        });
    }

    fn spawn_ping(
        &self,
        addr: String,
        known_membership_index: u64,
        hint: Arc<Mutex<Option<String>>>,
    ) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        let transport = Arc::clone(&self.inner.transport);
        let id = self.inner.id;
        let timeout = Duration::from_millis(self.inner.config.rpc_timeout_ms);
        tokio::spawn(async move {
            let sent_at = Instant::now();
            let env = Envelope {
                to: None,
                req: Request::Ping { from: id },
            };
            let resp = transport.call(&addr, env, timeout).await;
            let Some(inner) = weak.upgrade() else { return };
            match resp {
                Ok(Response::Pong {
                    membership_index,
                    member,
                    granted_ms,
                }) => {
                    inner.lease.lock().granted(sent_at, granted_ms);
                    if !member && membership_index > known_membership_index {
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
    removal: Option<JoinHandle<()>>,
    ping: Option<JoinHandle<()>>,
    hint: Arc<Mutex<Option<String>>>,
    next_peer: usize,
}
