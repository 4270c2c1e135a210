//! The broker's part in keeping a cluster's session directory (`crate::session::directory`)
//! true: it commits each session's detach and end, ends the sessions it is the keeper of
//! when their timeout runs out, and lets go of a session the directory moved away.

use super::Broker;
use crate::clock::now_ms;
use crate::cluster::OpOutcome;
use crate::core::{Effects, MoveStep, WiringOp};
use crate::session::directory::SessionOp;
use crate::session::{Ended, Left};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use uuid::Uuid;

/// How long a member keeps asking for one of its session changes to be committed.
const SESSION_COMMIT_PATIENCE: Duration = Duration::from_secs(60);

/// The first pause between two asks; it doubles up to [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two asks.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Submits an op again and again (`submit` sends it once, or answers `None` when it is no
/// longer wanted) until one is committed, pausing longer each time, for at most `patience`:
/// the last error if none was.
async fn until_committed(
    mut submit: impl FnMut() -> Option<oneshot::Receiver<OpOutcome>>,
    patience: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut pause = FIRST_RETRY_PAUSE;
    loop {
        let Some(outcome) = submit() else {
            return Ok(());
        };
        let error = match outcome.await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e.text,
            Err(_) => "the cluster member stopped".to_owned(),
        };
        if tokio::time::Instant::now() + pause > deadline {
            return Err(error);
        }
        tracing::debug!(%error, "session change not committed: asking again");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RETRY_PAUSE);
    }
}

impl Broker {
    /// A session ended here (closed, or timed out) or `moved` to another member: what it
    /// owned here goes — its channels' unacked deliveries back to their queues (held for
    /// the session if it moved: its client may have seen them, `core::queue::holds`), its
    /// exclusive and auto-delete queues.
    pub fn release_session(&self, ended: &Ended, moved: bool) {
        let Some(vhost) = ended.vhost.as_deref().and_then(|name| self.vhost(name)) else {
            return;
        };
        let mut fx = Effects::default();
        let mut v = vhost.lock();
        if moved {
            v.hand_channels_over(ended.owner, now_ms(), &mut fx);
        } else {
            v.close_channels_of(ended.owner, now_ms(), &mut fx);
        }
        v.connection_closed(ended.owner, &mut fx);
        self.finish_batch(ended.owner, &mut v, &mut fx);
    }

    /// Commits a change of one of this member's sessions to the cluster's directory (a
    /// detach or an end), without waiting. A commit whose outcome is unknown (the group's
    /// leader died with it) is asked again until it is committed: until then the directory
    /// says a connection holds the session, and every resume of it is refused with 405. Both
    /// ops are safe to repeat (one that finds the session settled changes nothing); a detach
    /// is asked again only while no connection here is attached to the session, so that a
    /// late one cannot detach a session its client resumed here meanwhile. A member that cannot
    /// commit for [`SESSION_COMMIT_PATIENCE`] has lost the majority and is evicted, and the
    /// others detach its sessions then anyway.
    pub fn commit_session(self: &Arc<Self>, op: SessionOp) {
        if let Some(cluster) = self.cluster().cloned() {
            let id = op.id().to_owned();
            let broker = Arc::downgrade(self);
            let mut asked = false;
            let submit = move || {
                let again = std::mem::replace(&mut asked, true);
                if again && let SessionOp::Detach { id, .. } = &op {
                    let broker = broker.upgrade()?;
                    let uuid = Uuid::parse_str(id).ok()?;
                    broker.sessions().has_no_connection(uuid).then_some(())?;
                }
                Some(cluster.submit("", WiringOp::Session(op.clone())))
            };
            tokio::spawn(async move {
                if let Err(e) = until_committed(submit, SESSION_COMMIT_PATIENCE).await {
                    tracing::warn!(session = %id, error = %e, "session change not committed");
                }
            });
        }
    }

    /// Session `id` is held here by connection `conn` of vhost `vhost` (started, resumed or
    /// taken over): its exclusive queues are that connection's, and the primary of each
    /// that is served by another member (the backup promoted when the session's member was
    /// lost, or the member the session left) moves here, as a planned move does — the
    /// queues follow their session (`docs/sessions.md` §4). Until a move is done the
    /// connection uses the queue over this member's link to its primary.
    pub fn adopt_session_queues(self: &Arc<Self>, vhost: &str, id: &str, conn: u64) {
        let Some(v) = self.vhost(vhost) else {
            return;
        };
        let names = v.lock().adopt_session_queues(id, conn);
        let Some(cluster) = self.cluster().cloned() else {
            return;
        };
        let me = cluster.node_id().to_owned();
        for name in names {
            let Some(roles) = cluster.queue_roles(vhost, &name) else {
                continue;
            };
            if roles.primary == me || roles.moving_to.as_deref() == Some(me.as_str()) {
                continue;
            }
            let op = WiringOp::MovePrimary {
                queue: name.to_string(),
                incarnation: roles.incarnation,
                to: me.clone(),
                step: MoveStep::Request,
            };
            let outcome = cluster.submit(vhost, op);
            let (session, queue) = (id.to_owned(), name);
            tokio::spawn(async move {
                match outcome.await {
                    Ok(Ok(_)) => {
                        tracing::info!(%session, %queue, "a session's exclusive queue moves to its session's member")
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%session, %queue, error = %e.text, "a session's exclusive queue cannot move to its session's member now: it is used over the link")
                    }
                    Err(_) => {}
                }
            });
        }
    }

    /// The directory moved session `id` away from this member, or ended it: what this member
    /// kept of it goes, and a connection still attached to it is closed with 320 (its
    /// client resumes where the directory says the session is). Its exclusive queues stay:
    /// the session owns them, wherever it is.
    pub fn session_left(&self, id: &str) {
        let Ok(uuid) = Uuid::parse_str(id) else {
            return;
        };
        match self.sessions().leave(uuid) {
            Some(Left::Detached(ended)) => {
                tracing::info!(session = %id, "session taken over by another member: its state here goes");
                if let Some(v) = ended.vhost.as_deref().and_then(|name| self.vhost(name)) {
                    v.lock().release_session_queues(id);
                }
                self.release_session(&ended, true);
            }
            Some(Left::Attached { owner }) => {
                tracing::warn!(session = %id, conn = owner, "session moved while a connection was attached here: closing it");
                self.force_close(owner, "the session moved to another cluster member");
            }
            None => {}
        }
    }

    /// Session `id` ended, as the directory agreed (on every member): its exclusive queues
    /// belong to nobody, and their primaries retire them.
    pub fn session_ended(&self, id: &str) {
        for (_, vhost) in self.vhosts() {
            let mut fx = Effects::default();
            let mut v = vhost.lock();
            v.session_ended(id, now_ms(), &mut fx);
            self.finish_batch(0, &mut v, &mut fx);
        }
    }

    /// Ends the sessions of the cluster that this member is the keeper of (see
    /// [`crate::session::directory::SessionDirectory::keeper`]) and that waited detached,
    /// with no state here, for their whole timeout — a member that failed or restarted held
    /// them. `waiting` remembers since when each has waited, as this member saw it.
    pub fn end_orphaned_sessions(
        self: &Arc<Self>,
        waiting: &mut HashMap<String, Instant>,
        now: Instant,
    ) {
        let Some(cluster) = self.cluster() else {
            return;
        };
        let me = cluster.node_id();
        let mut expired = Vec::new();
        let mut orphans = HashMap::new();
        for (id, r, keeper) in cluster.detached_sessions() {
            let local = Uuid::parse_str(&id).is_ok_and(|u| self.sessions().contains(u));
            if local || keeper.as_deref() != Some(me) {
                continue;
            }
            let since = waiting.get(&id).copied().unwrap_or(now);
            if now.saturating_duration_since(since) >= Duration::from_secs(r.timeout_s) {
                expired.push((id.clone(), r.member.clone()));
                // Asked again a timeout later if this end is not committed.
                orphans.insert(id, now);
            } else {
                orphans.insert(id, since);
            }
        }
        *waiting = orphans;
        for (id, member) in expired {
            tracing::info!(session = %id, %member, "session expired without a resume after its member was lost");
            self.commit_session(SessionOp::End { id, member });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{AmqpError, OpReply};
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A submit whose first `failures` asks end with an unknown outcome.
    fn failing(
        failures: u32,
        asks: &Arc<AtomicU32>,
    ) -> impl FnMut() -> Option<oneshot::Receiver<OpOutcome>> {
        let asks = Arc::clone(asks);
        move || {
            let n = asks.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(if n < failures {
                Err(AmqpError::new(506, "outcome unknown: peer unreachable"))
            } else {
                Ok((OpReply::default(), None))
            });
            Some(rx)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_change_whose_outcome_is_unknown_is_asked_again_until_committed() {
        let asks = Arc::new(AtomicU32::new(0));
        until_committed(failing(3, &asks), SESSION_COMMIT_PATIENCE)
            .await
            .expect("committed on the fourth ask");
        assert_eq!(asks.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_change_is_given_up_after_its_patience() {
        let asks = Arc::new(AtomicU32::new(0));
        let started = tokio::time::Instant::now();
        let e = until_committed(failing(u32::MAX, &asks), Duration::from_secs(5))
            .await
            .expect_err("never committed");
        assert!(e.contains("outcome unknown"), "{e}");
        assert!(started.elapsed() <= Duration::from_secs(5));
        assert!(asks.load(Ordering::SeqCst) > 3);
    }
}
