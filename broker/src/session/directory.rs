//! Where every session of a cluster lives: the session directory, a part of the cluster map
//! changed only by committed [`SessionOp`]s and by the configuration changes every member
//! applies in the same order. Any member answers a resume from it: 404 for a session no
//! member holds, 403 for another user's, 405 for one attached to a live connection — and
//! moves a detached one to itself with a committed [`SessionOp::Attach`], so that two
//! members racing for one session never both get it (the first committed wins).
//!
//! Pure: no clock (expiry is timed by the members, see `server::end_expired_sessions`), no
//! sockets. The session's state (its channels' publishing, unacked deliveries) stays with
//! the member that holds it; the directory holds who, for whom, and whether attached.

use crate::amqp::codes;
use crate::core::AmqpError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One session as every member of the cluster knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The user that started it: only that user resumes it.
    pub user: String,
    /// Its granted timeout, seconds: how long it outlives a lost connection.
    pub timeout_s: u64,
    /// Node id of the member that holds it (its primary).
    pub member: String,
    /// A connection is attached to it on `member`.
    pub attached: bool,
    /// Node id of the member it started on: it publishes into that member's fragment of a
    /// fragmented queue wherever it is resumed, so its messages stay in order
    /// ([`crate::core::fragments`]). Empty in records of members from before this field.
    #[serde(default)]
    pub origin: String,
}

/// A change to the session directory, committed through the cluster group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SessionOp {
    /// A client opened session `id` on `member`. Refused (405) if the id exists.
    Start {
        /// The session id (a UUID's text).
        id: String,
        /// Its user.
        user: String,
        /// Its granted timeout, seconds.
        timeout_s: u64,
        /// Node id of the member it starts on.
        member: String,
    },
    /// A client of `user` resumes session `id` on member `to`; `from` is where the resuming
    /// member saw it. Applied only if the session is still on `from` and detached, so a
    /// resume that lost a race is refused (405) instead of taking a session in use.
    Attach {
        /// The session id.
        id: String,
        /// The resuming user.
        user: String,
        /// Node id of the member the resuming member saw the session on.
        from: String,
        /// Node id of the resuming member.
        to: String,
    },
    /// The session's connection on `member` is gone; the session waits for a resume.
    /// Applied only if the session is still on `member`.
    Detach {
        /// The session id.
        id: String,
        /// Node id of the member whose connection went.
        member: String,
    },
    /// The session ended (a normal close, or its timeout ran out), as decided on `member`.
    /// Applied only if the session is still on `member`.
    End {
        /// The session id.
        id: String,
        /// Node id of the member that ended it.
        member: String,
    },
}

impl SessionOp {
    /// The session the op is about.
    pub fn id(&self) -> &str {
        match self {
            SessionOp::Start { id, .. }
            | SessionOp::Attach { id, .. }
            | SessionOp::Detach { id, .. }
            | SessionOp::End { id, .. } => id,
        }
    }
}

/// Whether `user` may attach session `id`, whose record is `record` (`None`: no member holds
/// it), seen detached on member `from` when one is named: the one rule behind a resume's
/// answer, checked early by the member asked and again, in agreed order, by the directory.
pub fn attachable<'a>(
    id: &str,
    record: Option<&'a SessionRecord>,
    user: &str,
    from: Option<&str>,
) -> Result<&'a SessionRecord, AmqpError> {
    let r = record.ok_or_else(|| {
        AmqpError::new(
            codes::NOT_FOUND,
            format!("no session {id} in this cluster: it never existed, ended, or expired"),
        )
    })?;
    if r.user != user {
        return Err(AmqpError::new(
            codes::ACCESS_REFUSED,
            format!("session {id} belongs to another user"),
        ));
    }
    if r.attached || from.is_some_and(|from| r.member != from) {
        return Err(AmqpError::new(
            codes::RESOURCE_LOCKED,
            format!("session {id} is attached to another connection"),
        ));
    }
    Ok(r)
}

/// One session's record before and after a change (`None`: it did not, or no longer, exist).
pub type SessionChange = (String, Option<SessionRecord>, Option<SessionRecord>);

/// Every session of the cluster, by id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionDirectory {
    sessions: BTreeMap<String, SessionRecord>,
}

impl SessionDirectory {
    /// The record of session `id`.
    pub fn get(&self, id: &str) -> Option<&SessionRecord> {
        self.sessions.get(id)
    }

    /// Every session, by id.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &SessionRecord)> {
        self.sessions.iter().map(|(id, r)| (id.as_str(), r))
    }

    /// How many sessions the cluster holds.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether the cluster holds no session.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Sets session `id`'s record (`None`: removes it): a copy following the map's changes.
    pub fn set(&mut self, id: &str, record: Option<SessionRecord>) {
        match record {
            Some(r) => {
                self.sessions.insert(id.to_owned(), r);
            }
            None => {
                self.sessions.remove(id);
            }
        }
    }

    /// Applies a committed op: the change it made (none for one that changed nothing), or
    /// the error its member answers its client with.
    pub fn apply(&mut self, op: &SessionOp) -> Result<Option<SessionChange>, AmqpError> {
        let id = op.id().to_owned();
        let was = self.sessions.get(&id).cloned();
        let now = match (op, &was) {
            (
                SessionOp::Start {
                    user,
                    timeout_s,
                    member,
                    ..
                },
                None,
            ) => SessionRecord {
                user: user.clone(),
                timeout_s: *timeout_s,
                member: member.clone(),
                attached: true,
                origin: member.clone(),
            },
            (SessionOp::Start { .. }, Some(_)) => {
                return Err(AmqpError::new(
                    codes::RESOURCE_LOCKED,
                    format!("session {id} exists already: resume it, or start one with a new id"),
                ));
            }
            (SessionOp::Attach { user, from, to, .. }, r) => {
                let r = attachable(&id, r.as_ref(), user, Some(from))?;
                SessionRecord {
                    member: to.clone(),
                    attached: true,
                    ..r.clone()
                }
            }
            (SessionOp::Detach { member, .. }, Some(r)) if &r.member == member => SessionRecord {
                attached: false,
                ..r.clone()
            },
            (SessionOp::End { member, .. }, Some(r)) if &r.member == member => {
                self.sessions.remove(&id);
                return Ok(Some((id, was, None)));
            }
            // Detach or end of a session that moved on, or is gone: already settled.
            (SessionOp::Detach { .. } | SessionOp::End { .. }, _) => return Ok(None),
        };
        if was.as_ref() == Some(&now) {
            return Ok(None);
        }
        self.sessions.insert(id.clone(), now.clone());
        Ok(Some((id, was, Some(now))))
    }

    /// The cluster's members are now `ring` (node ids): a session attached on a member that
    /// left has no connection any more — it waits, detached, for a resume anywhere.
    pub fn members_are(&mut self, ring: &[String]) -> Vec<SessionChange> {
        self.detach_where(|r| !ring.contains(&r.member))
    }

    /// Member `node` restarted in place: the new process holds none of its sessions'
    /// connections (nor their state), so they wait, detached, for a resume.
    pub fn restarted(&mut self, node: &str) -> Vec<SessionChange> {
        self.detach_where(|r| r.member == node)
    }

    fn detach_where(&mut self, lost: impl Fn(&SessionRecord) -> bool) -> Vec<SessionChange> {
        let mut changes = Vec::new();
        for (id, r) in &mut self.sessions {
            if r.attached && lost(r) {
                let was = r.clone();
                r.attached = false;
                changes.push((id.clone(), Some(was), Some(r.clone())));
            }
        }
        changes
    }

    /// The member that ends session `id` when its timeout runs out without a resume: the
    /// member holding it while that member is in the cluster (`ring`, node ids in ring order),
    /// else the first member of the ring — a rule every member computes alike, so exactly
    /// one member times an orphaned session out.
    pub fn keeper<'a>(&'a self, id: &str, ring: &'a [String]) -> Option<&'a str> {
        let r = self.sessions.get(id)?;
        if ring.contains(&r.member) {
            Some(&r.member)
        } else {
            ring.first().map(String::as_str)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(id: &str, member: &str) -> SessionOp {
        SessionOp::Start {
            id: id.into(),
            user: "guest".into(),
            timeout_s: 60,
            member: member.into(),
        }
    }

    fn attach(id: &str, user: &str, from: &str, to: &str) -> SessionOp {
        SessionOp::Attach {
            id: id.into(),
            user: user.into(),
            from: from.into(),
            to: to.into(),
        }
    }

    fn detach(id: &str, member: &str) -> SessionOp {
        SessionOp::Detach {
            id: id.into(),
            member: member.into(),
        }
    }

    fn code(r: Result<Option<SessionChange>, AmqpError>) -> u16 {
        r.expect_err("refused").code
    }

    #[test]
    fn a_session_id_is_taken_once() {
        let mut d = SessionDirectory::default();
        assert!(d.apply(&start("s", "a")).unwrap().is_some());
        assert_eq!(code(d.apply(&start("s", "b"))), codes::RESOURCE_LOCKED);
        assert_eq!(d.get("s").unwrap().member, "a");
        assert!(d.get("s").unwrap().attached);
    }

    #[test]
    fn a_resume_takes_a_detached_session_and_refuses_an_attached_or_unknown_one() {
        let mut d = SessionDirectory::default();
        assert_eq!(
            code(d.apply(&attach("s", "guest", "a", "b"))),
            codes::NOT_FOUND
        );
        d.apply(&start("s", "a")).unwrap();
        assert_eq!(
            code(d.apply(&attach("s", "guest", "a", "b"))),
            codes::RESOURCE_LOCKED,
            "attached on a"
        );
        d.apply(&detach("s", "a")).unwrap();
        assert_eq!(
            code(d.apply(&attach("s", "mallory", "a", "b"))),
            codes::ACCESS_REFUSED
        );
        let (_, was, now) = d.apply(&attach("s", "guest", "a", "b")).unwrap().unwrap();
        assert_eq!(was.unwrap().member, "a");
        assert_eq!(now.unwrap().member, "b");
        assert_eq!(
            code(d.apply(&attach("s", "guest", "a", "c"))),
            codes::RESOURCE_LOCKED,
            "the race's loser saw it on a"
        );
    }

    #[test]
    fn a_late_detach_or_end_from_a_member_that_no_longer_holds_the_session_changes_nothing() {
        let mut d = SessionDirectory::default();
        d.apply(&start("s", "a")).unwrap();
        d.apply(&detach("s", "a")).unwrap();
        d.apply(&attach("s", "guest", "a", "b")).unwrap();
        assert_eq!(d.apply(&detach("s", "a")), Ok(None));
        assert_eq!(
            d.apply(&SessionOp::End {
                id: "s".into(),
                member: "a".into()
            }),
            Ok(None)
        );
        assert!(d.get("s").unwrap().attached);
        let (_, _, now) = d
            .apply(&SessionOp::End {
                id: "s".into(),
                member: "b".into(),
            })
            .unwrap()
            .unwrap();
        assert_eq!(now, None);
        assert!(d.is_empty());
    }

    #[test]
    fn a_lost_or_restarted_member_leaves_its_sessions_detached_and_the_ring_times_them_out() {
        let mut d = SessionDirectory::default();
        d.apply(&start("s1", "a")).unwrap();
        d.apply(&start("s2", "b")).unwrap();
        let ring = vec!["b".to_owned(), "c".to_owned()];
        let changes = d.members_are(&ring);
        assert_eq!(changes.len(), 1);
        assert!(!d.get("s1").unwrap().attached);
        assert!(d.get("s2").unwrap().attached);
        assert_eq!(d.keeper("s1", &ring), Some("b"), "a left: the ring's first");
        assert_eq!(d.keeper("s2", &ring), Some("b"));
        assert_eq!(d.restarted("b").len(), 1);
        assert!(!d.get("s2").unwrap().attached);
        assert_eq!(d.keeper("nope", &ring), None);
    }
}
