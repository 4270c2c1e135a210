//! The broker's part in keeping a cluster's session directory (`crate::session::directory`)
//! true: it commits each session's detach and end, ends the sessions it is the keeper of
//! when their timeout runs out, and lets go of a session the directory moved away.

use super::Broker;
use crate::clock::now_ms;
use crate::core::{Effects, WiringOp};
use crate::session::directory::SessionOp;
use crate::session::{Ended, Left};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use uuid::Uuid;

impl Broker {
    /// A session ended here (closed, or timed out): what it owned goes — its channels'
    /// unacked deliveries back to their queues, its exclusive and auto-delete queues.
    pub fn release_session(&self, ended: &Ended) {
        let Some(vhost) = ended.vhost.as_deref().and_then(|name| self.vhost(name)) else {
            return;
        };
        let mut fx = Effects::default();
        let mut v = vhost.lock();
        v.close_channels_of(ended.owner, now_ms(), &mut fx);
        v.connection_closed(ended.owner, &mut fx);
        self.finish_batch(ended.owner, &mut v, &mut fx);
    }

    /// Commits a change of one of this member's sessions to the cluster's directory (a
    /// detach or an end), without waiting: a member that cannot commit has lost the
    /// majority and is evicted, and the others detach its sessions then anyway.
    pub fn commit_session(&self, op: SessionOp) {
        if let Some(cluster) = self.cluster() {
            let id = op.id().to_owned();
            let outcome = cluster.submit("", WiringOp::Session(op));
            tokio::spawn(async move {
                if let Ok(Err(e)) = outcome.await {
                    tracing::warn!(session = %id, error = %e.text, "session change not committed");
                }
            });
        }
    }

    /// The directory moved session `id` away from this member, or ended it: what this member
    /// kept of it goes, and a connection still attached to it is closed with 320 (its
    /// client resumes where the directory says the session is).
    pub fn session_left(&self, id: &str) {
        let Ok(uuid) = Uuid::parse_str(id) else {
            return;
        };
        match self.sessions().leave(uuid) {
            Some(Left::Detached(ended)) => {
                tracing::info!(session = %id, "session taken over by another member: its state here goes");
                self.release_session(&ended);
            }
            Some(Left::Attached { owner }) => {
                tracing::warn!(session = %id, conn = owner, "session moved while a connection was attached here: closing it");
                self.force_close(owner, "the session moved to another cluster member");
            }
            None => {}
        }
    }

    /// Ends the sessions of the cluster that this member is the keeper of (see
    /// [`crate::session::directory::SessionDirectory::keeper`]) and that waited detached,
    /// with no state here, for their whole timeout — a member that failed or restarted held
    /// them. `waiting` remembers since when each has waited, as this member saw it.
    pub fn end_orphaned_sessions(&self, waiting: &mut HashMap<String, Instant>, now: Instant) {
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
