//! A resumable session's exclusive queues on a cluster (`docs/sessions.md` §4): owned by the
//! session, not by a connection or a member. Every member knows which session owns such a
//! queue; the member holding the session gives it to the session's connection there, and
//! the others refuse it to their own connections but let the session's member use it over
//! its link (the queue's primary need not be where the session is: after a failover it is
//! the promoted backup, until the queue's planned move to the session's member is done).
//! The queue goes when the session ends, not when a connection does.

use super::VHost;
use crate::core::{Effects, NO_CONNECTION};
use std::sync::Arc;

/// An exclusive queue's owner as a cluster op declaring it names it
/// ([`crate::core::OWNER_ARGUMENT`]): the broker run and connection that declared it, and
/// the session that owns it, if a session's connection did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerToken<'a> {
    /// The declaring broker run's name seed.
    pub run: u64,
    /// The declaring connection, on that run.
    pub conn: u64,
    /// The session that owns the queue.
    pub session: Option<&'a str>,
}

impl<'a> OwnerToken<'a> {
    /// Reads `<run hex>:<conn>[:<session id>]`; `None` when malformed.
    pub fn parse(token: &'a str) -> Option<Self> {
        let mut parts = token.splitn(3, ':');
        let run = u64::from_str_radix(parts.next()?, 16).ok()?;
        let conn = parts.next()?.parse().ok()?;
        let session = parts.next().filter(|s| !s.is_empty());
        Some(Self { run, conn, session })
    }
}

impl VHost {
    /// What a cluster op declaring an exclusive queue for connection `conn` carries to name
    /// its owner ([`crate::core::OWNER_ARGUMENT`]): this broker run and the connection, so
    /// that the op replayed by a later run owns nothing, and the connection's session if it
    /// has one, so that the queue outlives the connection and follows the session.
    pub fn exclusive_owner_token(&self, conn: u64, session: Option<&str>) -> String {
        match session {
            Some(id) => format!("{:x}:{conn}:{id}", self.name_seed),
            None => format!("{:x}:{conn}", self.name_seed),
        }
    }

    /// The connection of this broker run an owner token names; [`NO_CONNECTION`] for
    /// another run's (or a malformed) token.
    pub fn token_owner(&self, token: &str) -> u64 {
        match OwnerToken::parse(token) {
            Some(t) if t.run == self.name_seed => t.conn,
            _ => NO_CONNECTION,
        }
    }

    /// Marks queue `name` as session `session`'s (a declare's cluster op named it).
    pub(crate) fn set_queue_session(&mut self, name: &str, session: &str) {
        if let Some(q) = self.queues.get_mut(name) {
            q.session = Some(Arc::from(session));
        }
    }

    /// Session `session` is held here by connection `conn` now (started, resumed or taken
    /// over): its exclusive queues are that connection's. Returns their names, for the
    /// caller to move the primaries of those served elsewhere here.
    pub fn adopt_session_queues(&mut self, session: &str, conn: u64) -> Vec<Arc<str>> {
        self.queues
            .values_mut()
            .filter(|q| q.session.as_deref() == Some(session))
            .map(|q| {
                q.exclusive_owner = Some(conn);
                q.name.clone()
            })
            .collect()
    }

    /// Session `session` left this member (the directory moved it to another): its
    /// exclusive queues stay — the session owns them — but no connection here does.
    pub fn release_session_queues(&mut self, session: &str) {
        for q in self.queues.values_mut() {
            if q.session.as_deref() == Some(session) {
                q.exclusive_owner = Some(NO_CONNECTION);
            }
        }
    }

    /// Session `session` ended (closed or timed out, agreed by the directory on every
    /// member): its exclusive queues belong to nobody, and their primary retires them by a
    /// cluster op, now and on every tick until one is taken; the messages held for it go to
    /// anyone, and the queues forget their deliveries to it (`core::queue::holds`).
    pub fn session_ended(&mut self, session: &str, now_ms: u64, fx: &mut Effects) {
        let released: Vec<Arc<str>> = self
            .queues
            .values_mut()
            .filter_map(|q| q.forget_session(session).then(|| q.name.clone()))
            .collect();
        self.dispatch_all(released, now_ms, fx);
        let ended: Vec<Arc<str>> = self
            .queues
            .values()
            .filter(|q| q.session.as_deref() == Some(session))
            .map(|q| q.name.clone())
            .collect();
        for name in ended {
            let served_here = self
                .queues
                .get(&name)
                .is_some_and(|q| q.primary_elsewhere(self.node.as_deref()).is_none());
            if let Some(q) = self.queues.get_mut(&name) {
                q.exclusive_owner = Some(NO_CONNECTION);
                q.session = None;
            }
            if served_here {
                self.retire_queue(&name, fx);
            }
        }
    }

    /// Connection `conn` is another cluster member's link: it may use the session queues
    /// whose primary is here for the session's connection there ([`VHost::may_use`]).
    pub fn link_opened(&mut self, conn: u64) {
        self.links.insert(conn);
    }

    /// Link connection `conn` closed.
    pub fn link_closed(&mut self, conn: u64) {
        self.links.remove(&conn);
    }

    /// Whether connection `conn` may use queue `name` as its exclusivity goes (403 on
    /// another connection's exclusive queue is 405 RESOURCE_LOCKED, as RabbitMQ answers):
    /// checked here before a use is passed on to the queue's primary on another member,
    /// which trusts this member's check. An unknown queue passes (the primary answers).
    pub fn check_exclusive(&self, name: &str, conn: u64) -> crate::core::CoreResult<()> {
        match self.queues.get(name) {
            Some(q) if !self.may_use(q, conn) => Err(self.locked(name)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OwnerToken;

    #[test]
    fn an_owner_token_names_its_run_connection_and_session() {
        let t = OwnerToken::parse("1f:7:8c1d6a0e-5b1e-4f3a-9d2c-0a1b2c3d4e5f").unwrap();
        assert_eq!((t.run, t.conn), (0x1f, 7));
        assert_eq!(t.session, Some("8c1d6a0e-5b1e-4f3a-9d2c-0a1b2c3d4e5f"));
        let plain = OwnerToken::parse("1f:7").unwrap();
        assert_eq!(plain.session, None);
        assert_eq!(OwnerToken::parse("zz:7"), None);
        assert_eq!(OwnerToken::parse("1f"), None);
    }
}
