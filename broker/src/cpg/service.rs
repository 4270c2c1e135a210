//! Answers what peers ask of this member: Raft RPCs go to openraft, pings renew leases and prove
//! liveness, joins admit new members, forwarded writes are proposed by the leader.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, Raft, RaftMetrics, ServerState};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::lease::Lease;
use super::types::{Command, CpgTypes, MemberId};
use super::wire::{Envelope, Request, Response};

/// The server side of one member.
pub(crate) struct Service {
    id: MemberId,
    raft: Raft<CpgTypes>,
    lease: Arc<Mutex<Lease>>,
    failed: Arc<Mutex<BTreeSet<MemberId>>>,
    write_timeout: Duration,
}

impl Service {
    /// Serves member `id` backed by `raft`; admissions and writes give up after `write_timeout`.
    pub fn new(
        id: MemberId,
        raft: Raft<CpgTypes>,
        lease: Arc<Mutex<Lease>>,
        failed: Arc<Mutex<BTreeSet<MemberId>>>,
        write_timeout: Duration,
    ) -> Self {
        Self {
            id,
            raft,
            lease,
            failed,
            write_timeout,
        }
    }

    /// The member this service answers for.
    pub fn id(&self) -> MemberId {
        self.id
    }

    /// Answers one request.
    pub async fn handle(&self, env: Envelope) -> Response {
        if env.to.is_some_and(|to| to != self.id) {
            return Response::WrongTarget;
        }
        match env.req {
            Request::Append(r) => {
                // Recorded whatever the answer, even if this task is dropped mid-way: a new
                // leader counts earlier terms' leases as over only from this member's last
                // acknowledgement of one (`TermAcks`).
                let _appending = Appending::new(&self.lease, r.vote.leader_id().get_term());
                match self.raft.append_entries(r).await {
                    Ok(r) => Response::Append(r),
                    Err(e) => Response::Failed(e.to_string()),
                }
            }
            Request::Vote(r) => match self.raft.vote(r).await {
                Ok(r) => Response::Vote(r),
                Err(e) => Response::Failed(e.to_string()),
            },
            Request::Snapshot(r) => {
                // From a leader too: recorded as an acknowledgement of its term, like an append.
                let _appending = Appending::new(&self.lease, r.vote.leader_id().get_term());
                match self.raft.install_snapshot(r).await {
                    Ok(r) => Response::Snapshot(r),
                    Err(e) => Response::Failed(e.to_string()),
                }
            }
            Request::Ping {
                from,
                term,
                since_older_ms,
            } => self.ping(from, term, since_older_ms),
            Request::Join { id, addr } => self.admit(id, addr).await,
            Request::Write(cmd) => self.write(cmd).await,
            Request::ReadIndex => self.read_index().await,
            Request::Retire { id } => self.retire(id).await,
        }
    }

    fn not_leader(&self) -> Response {
        Self::redirect(&self.raft.metrics().borrow())
    }

    /// `NotLeader` naming the leader these metrics know of. It takes the metrics a caller
    /// already holds: borrowing them a second time on one thread deadlocks as soon as
    /// openraft waits to publish new ones (a writer waiting on the watch's lock blocks new
    /// readers), which once hung a follower answering a restarted member's joins.
    fn redirect(m: &RaftMetrics<MemberId, BasicNode>) -> Response {
        let leader = m.current_leader.and_then(|l| {
            m.membership_config
                .membership()
                .get_node(&l)
                .map(|n| n.addr.clone())
        });
        Response::NotLeader { leader }
    }

    fn ping(&self, from: MemberId, term: u64, since_older_ms: u64) -> Response {
        let (is_leader, current_term, membership_index, in_newest, removed, caught_up, committed) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            // A member the newest (maybe uncommitted) configuration drops is on its way out and
            // gets no new lease; it is told it was removed only once that is committed, since
            // an uncommitted removal may still need its vote.
            let in_newest = membership
                .get_joint_config()
                .last()
                .is_some_and(|c| c.contains(&from));
            let committed =
                m.membership_config.log_id().map(|l| l.index) <= m.last_applied.map(|l| l.index);
            let removed = committed && !membership.voter_ids().any(|v| v == from);
            let index = m.membership_config.log_id().map_or(0, |l| l.index);
            // A new leader grants nothing until it has applied an entry of its own term, so
            // it knows every failure an earlier leader proposed (such an entry commits with
            // its first one).
            let caught_up = m
                .last_applied
                .is_some_and(|l| l.leader_id.term == m.current_term);
            (
                m.state == ServerState::Leader,
                m.current_term,
                index,
                in_newest,
                removed,
                caught_up,
                m.last_applied.map_or(0, |l| l.index),
            )
        };
        if !is_leader {
            return self.not_leader();
        }
        let granted_ms = {
            let now = Instant::now();
            let mut lease = self.lease.lock();
            if !removed {
                lease.heard(from, now);
                if term == current_term {
                    lease.reported(from, term, since_older_ms, now);
                }
            }
            if in_newest && caught_up && !self.failed.lock().contains(&from) {
                lease.grant_ms(from, now)
            } else {
                0
            }
        };
        Response::Pong {
            membership_index,
            member: !removed,
            granted_ms,
            committed,
        }
    }

    async fn read_index(&self) -> Response {
        match tokio::time::timeout(self.write_timeout, self.raft.get_read_log_id()).await {
            Ok(Ok((read, _))) => Response::ReadIndex(read.map_or(0, |l| l.index)),
            Ok(Err(RaftError::APIError(_))) => self.not_leader(),
            Ok(Err(e)) => Response::Failed(e.to_string()),
            Err(_) => Response::Failed("read index timed out".into()),
        }
    }

    async fn admit(&self, id: MemberId, addr: String) -> Response {
        let known = {
            let m = self.raft.metrics();
            let m = m.borrow();
            if m.state != ServerState::Leader {
                return Self::redirect(&m);
            }
            let membership = m.membership_config.membership();
            membership
                .voter_ids()
                .any(|v| v == id)
                .then(|| membership.get_node(&id).map(|n| n.addr.clone()))
        };
        let raft = &self.raft;
        match known {
            Some(Some(known)) if known == addr => return Response::Joined,
            Some(_) => {
                // A restarted voter that came back at another address.
                let change = raft.change_membership(
                    ChangeMembers::SetNodes(BTreeMap::from([(
                        id,
                        BasicNode { addr: addr.clone() },
                    )])),
                    false,
                );
                return match tokio::time::timeout(self.write_timeout, change).await {
                    Ok(Ok(_)) => {
                        tracing::info!(member = self.id, moved = id, %addr, "a cluster member's address changed");
                        Response::Joined
                    }
                    Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => {
                        self.not_leader()
                    }
                    Ok(Err(e)) => Response::Failed(e.to_string()),
                    Err(_) => Response::Failed("address change timed out".into()),
                };
            }
            None => {}
        }
        let admitted = tokio::time::timeout(self.write_timeout, async {
            raft.add_learner(id, BasicNode { addr: addr.clone() }, true)
                .await?;
            raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
                .await
        })
        .await;
        match admitted {
            Ok(Ok(_)) => {
                tracing::info!(member = self.id, joined = id, %addr, "admitted a new cluster member");
                Response::Joined
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => self.not_leader(),
            Ok(Err(e)) => Response::Failed(e.to_string()),
            Err(_) => Response::Failed("admission timed out".into()),
        }
    }

    /// Removes voter `id`, which leaves for good. Unlike the monitor's removal of a failed
    /// voter (only from even sets), this may remove from any set, but only while a majority
    /// of the voters that stay was heard from lately: the member asks itself, so it is alive
    /// when the removal is proposed, and the removal then commits (it needs a majority of
    /// both sets) and the members that stay can go on without it. Proposed without such a
    /// majority, the joint configuration could stick needing a member that is down (three
    /// voters, one crashed, the retiring one gone: the third alone) where keeping the vote
    /// would have let the retiring member's restart restore quorum; so it is refused, and
    /// the member keeps its vote.
    async fn retire(&self, id: MemberId) -> Response {
        let (is_leader, voter, staying) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            (
                m.state == ServerState::Leader,
                membership.voter_ids().any(|v| v == id),
                membership
                    .voter_ids()
                    .filter(|v| *v != id)
                    .collect::<Vec<_>>(),
            )
        };
        if !is_leader {
            return self.not_leader();
        }
        if !voter {
            return Response::Retired;
        }
        if staying.is_empty() {
            return Response::Failed("the cluster's last voter cannot leave it".into());
        }
        let fresh = self
            .lease
            .lock()
            .fresh_count(Instant::now(), self.id, &staying);
        if fresh * 2 <= staying.len() {
            return Response::Failed(format!(
                "only {fresh} of the {} voters that would stay were heard from lately: no majority to go on without it",
                staying.len()
            ));
        }
        let change = self
            .raft
            .change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([id])), false);
        match tokio::time::timeout(self.write_timeout, change).await {
            Ok(Ok(_)) => {
                tracing::info!(
                    member = self.id,
                    retired = id,
                    "a member left the cluster for good"
                );
                Response::Retired
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => self.not_leader(),
            Ok(Err(e)) => Response::Failed(e.to_string()),
            Err(_) => Response::Failed("the voter removal timed out".into()),
        }
    }

    async fn write(&self, cmd: Command) -> Response {
        match tokio::time::timeout(self.write_timeout, self.raft.client_write(cmd)).await {
            Ok(Ok(r)) => Response::Written(r.data),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                Response::NotLeader {
                    leader: f.leader_node.map(|n| n.addr),
                }
            }
            Ok(Err(e)) => Response::Failed(e.to_string()),
            Err(_) => Response::Failed("write timed out".into()),
        }
    }
}

/// An append being handled: announced to the member's [`super::term_acks::TermAcks`] when it
/// arrives, recorded as acknowledged when it is answered or abandoned.
struct Appending<'a> {
    lease: &'a Mutex<Lease>,
    term: u64,
}

impl<'a> Appending<'a> {
    fn new(lease: &'a Mutex<Lease>, term: u64) -> Self {
        lease.lock().acks.appending(term);
        Self { lease, term }
    }
}

impl Drop for Appending<'_> {
    fn drop(&mut self) {
        self.lease.lock().acks.appended(self.term, Instant::now());
    }
}
