//! Resumable sessions (`docs/sessions.md`): a client names a session in its `start-ok`
//! client-properties, and the session outlives a lost connection for its granted timeout, so
//! that the client can resume it and find what the session owns — its exclusive and
//! auto-delete queues, with their content — still there.
//!
//! The registry is the broker's record of its sessions; it holds no sockets and reads no
//! clock (the caller passes the time), so its rules are tested without I/O. A session's
//! *owner id* is the connection id of the connection that started it: every connection
//! attached to the session takes that id, so that what the vhost core keys by connection
//! (exclusive queues, channels, deliveries' mailboxes) follows the session, not the socket.

use crate::amqp::{AMQPValue, FieldTable, Properties, ShortString, codes};
use crate::core::Message;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use uuid::Uuid;

pub mod directory;

/// Client property that opens a new session.
pub const START_PROPERTY: &str = "qpid.session.start";
/// Client property that resumes a session.
pub const RESUME_PROPERTY: &str = "qpid.session.resume";
/// Client property asking for a timeout (seconds); server property with the maximum.
pub const TIMEOUT_PROPERTY: &str = "qpid.session.timeout";
/// The capability a broker that offers sessions advertises.
pub const CAPABILITY: &str = "qpid.session";
/// `connection.close` reply code with which a client closes its connection and keeps its
/// session (the design note's new code).
pub const KEEP_SESSION: u16 = 330;
/// The pseudo-queue from which a session's connection reads its status (`docs/sessions.md`).
pub const STATUS_QUEUE: &str = "amq.session";
/// Message header with which a client resending a publish after a resume names its number
/// on the channel (1-based, counting every `basic.publish` since the channel was first
/// opened): the broker drops a publish it already processed — and confirms it again, with
/// its first outcome, in confirm mode. A queue drops it too, when a member that took the
/// session over resends it (`core::producers`).
pub use crate::core::producers::PUBLISH_SEQ_HEADER;
/// How many of a channel's most recent nacked confirm numbers it remembers, to answer a
/// resent duplicate with the outcome it first had. Nacks are rare (a refused publish, an
/// unavailable queue); a resent publish is one of the client's in-flight window, far newer.
pub const NACK_MEMORY: usize = 4096;

/// Why a session could not be opened or resumed: the `connection.close` reply code and text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text}")]
pub struct SessionError {
    /// The AMQP reply code.
    pub code: u16,
    /// What to fix, naming the session.
    pub text: String,
}

impl SessionError {
    fn new(code: u16, text: impl Into<String>) -> SessionError {
        SessionError {
            code,
            text: text.into(),
        }
    }
}

/// What a client asked for in its client-properties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionRequest {
    /// Open session `id`, kept `timeout_s` seconds after a lost connection (`None`: the
    /// broker's default).
    Start {
        /// The session id the client generated.
        id: Uuid,
        /// The timeout it asked for.
        timeout_s: Option<u64>,
    },
    /// Resume session `id`.
    Resume {
        /// The session id.
        id: Uuid,
    },
}

/// Reads the session properties of a `start-ok`: `None` for a client that asks for no session.
pub fn parse_request(props: &FieldTable) -> Result<Option<SessionRequest>, SessionError> {
    let get = |name: &str| props.inner().get(name);
    let id = |name: &str, value: &AMQPValue| -> Result<Uuid, SessionError> {
        let text = match value {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::ShortString(s) => s.as_str().to_owned(),
            other => {
                return Err(SessionError::new(
                    codes::NOT_ALLOWED,
                    format!(
                        "client property {name} must be a string holding a UUID, not {other:?}"
                    ),
                ));
            }
        };
        Uuid::parse_str(text.trim()).map_err(|e| {
            SessionError::new(
                codes::NOT_ALLOWED,
                format!("client property {name} '{text}' is not a UUID: {e}"),
            )
        })
    };
    match (get(START_PROPERTY), get(RESUME_PROPERTY)) {
        (Some(_), Some(_)) => Err(SessionError::new(
            codes::NOT_ALLOWED,
            format!(
                "client properties {START_PROPERTY} and {RESUME_PROPERTY} exclude each other: send one"
            ),
        )),
        (Some(start), None) => {
            let timeout_s = match get(TIMEOUT_PROPERTY) {
                None => None,
                Some(v) => Some(integer(v).ok_or_else(|| {
                    SessionError::new(
                        codes::NOT_ALLOWED,
                        format!("client property {TIMEOUT_PROPERTY} must be an integer number of seconds >= 0, not {v:?}"),
                    )
                })?),
            };
            Ok(Some(SessionRequest::Start {
                id: id(START_PROPERTY, start)?,
                timeout_s,
            }))
        }
        (None, Some(resume)) => Ok(Some(SessionRequest::Resume {
            id: id(RESUME_PROPERTY, resume)?,
        })),
        (None, None) => Ok(None),
    }
}

/// A non-negative integer of any AMQP integer type, or a string of decimal digits (some
/// client libraries, lapin among them, set only string client-properties).
pub fn integer(v: &AMQPValue) -> Option<u64> {
    match v {
        AMQPValue::LongString(s) => {
            return std::str::from_utf8(s.as_bytes()).ok()?.trim().parse().ok();
        }
        AMQPValue::ShortString(s) => return s.as_str().trim().parse().ok(),
        _ => {}
    }
    match *v {
        AMQPValue::ShortShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(n.into()),
        AMQPValue::ShortInt(n) => u64::try_from(n).ok(),
        AMQPValue::ShortUInt(n) => Some(n.into()),
        AMQPValue::LongInt(n) => u64::try_from(n).ok(),
        AMQPValue::LongUInt(n) => Some(n.into()),
        AMQPValue::LongLongInt(n) => u64::try_from(n).ok(),
        AMQPValue::Timestamp(n) => Some(n),
        _ => None,
    }
}

/// What a session's channel keeps of its publishing across connections, so that a resumed
/// channel goes on where it stopped: its publish count (which resent publishes are
/// duplicates), its mode, and the outcomes a resent duplicate is confirmed with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishState {
    /// `basic.publish` commands the channel processed since it was first opened: routed, or
    /// discarded by a transaction's commit or rollback (an open transaction's publishes are
    /// not counted until then — lost with a connection, they are sent again).
    pub published: u64,
    /// `published` when `confirm.select` came (`None`: not in confirm mode): a publish's
    /// confirm number is its number less this.
    pub confirm_base: Option<u64>,
    /// The most recent confirm numbers that were nacked (at most [`NACK_MEMORY`]), ascending.
    pub nacks: VecDeque<u64>,
    /// The most recent confirm numbers whose publish's fate is unknown (at most
    /// [`NACK_MEMORY`]): forwarded to a primary that was lost before it answered. Their
    /// confirms were never sent; a resend of one is routed again, and each queue that took
    /// the first copy drops it by its producer and number (`core::producers`).
    pub unknown: VecDeque<u64>,
    /// `tx.select` came.
    pub transactional: bool,
    /// `tx.commit`s applied: a client that lost its connection during a commit learns
    /// whether it went through (and so whether to send the transaction again).
    pub commits: u64,
}

impl PublishState {
    /// Whether the channel is in confirm mode.
    pub fn confirming(&self) -> bool {
        self.confirm_base.is_some()
    }

    /// Counts a publish the channel processes now; in confirm mode its confirm number.
    pub fn count_publish(&mut self) -> Option<u64> {
        self.published += 1;
        self.confirm_base.map(|base| self.published - base)
    }

    /// Remembers that the fate of confirm number `n` is unknown (see [`Self::unknown`]).
    pub fn record_unknown(&mut self, n: u64) {
        remember(&mut self.unknown, n);
    }

    /// A resend of confirm number `n` is routed again if its fate is unknown: true (and `n`
    /// is no longer unknown: the new routing decides it).
    pub fn retry_unknown(&mut self, n: u64) -> bool {
        let Some(i) = self.unknown.iter().position(|&u| u == n) else {
            return false;
        };
        self.unknown.remove(i);
        true
    }

    /// Remembers that confirm number `n` was nacked.
    pub fn record_nack(&mut self, n: u64) {
        remember(&mut self.nacks, n);
    }

    /// Whether the publish numbered `seq` on the channel was processed already: a resent
    /// duplicate, to be dropped.
    pub fn is_duplicate(&self, seq: u64) -> bool {
        seq <= self.published
    }

    /// A publish numbered `seq` by its client that the channel has not processed: a channel
    /// that knows less of the client's numbering than the client — one resumed on a member
    /// that took the session over, which starts with none of its channels' state — takes
    /// the client's, so that its confirm numbers are the ones the client expects. (Inside a
    /// transaction publishes are counted at the commit; the numbering stays.)
    pub fn number_from(&mut self, seq: u64) {
        if !self.transactional && seq > self.published + 1 {
            self.published = seq - 1;
        }
    }

    /// The confirm a resent duplicate numbered `seq` gets: its confirm number and whether it
    /// is an ack (the outcome it first had). `None` outside confirm mode, or for a publish
    /// sent before `confirm.select`.
    pub fn confirm_of(&self, seq: u64) -> Option<(u64, bool)> {
        let base = self.confirm_base?;
        let n = seq.checked_sub(base).filter(|&n| n > 0)?;
        Some((n, !self.nacks.contains(&n)))
    }
}

/// Appends confirm number `n` to a channel's memory of them, the oldest forgotten past
/// [`NACK_MEMORY`].
fn remember(numbers: &mut VecDeque<u64>, n: u64) {
    if numbers.len() == NACK_MEMORY {
        numbers.pop_front();
    }
    numbers.push_back(n);
}

/// What the confirms a session's last connection could not send any more waited for: a
/// resent duplicate's confirm, which stands for one of them, waits for it too. Both only
/// grow (a journal sequence number, a replication stamp).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Barrier {
    /// The journal sequence number that must be durable.
    pub journal_seq: u64,
    /// The replication stamp every in-sync backup must have acknowledged.
    pub replicated: u64,
}

impl Barrier {
    /// The later of two barriers.
    pub fn max(self, other: Barrier) -> Barrier {
        Barrier {
            journal_seq: self.journal_seq.max(other.journal_seq),
            replicated: self.replicated.max(other.replicated),
        }
    }
}

/// One channel of a session as its status lists it (`docs/sessions.md`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelStatus {
    /// The channel number.
    pub channel: u16,
    /// The delivery tag its next delivery gets.
    pub next_delivery_tag: u64,
    /// Its deliveries not yet acknowledged, by tag.
    pub unacked: Vec<u64>,
    /// Its publishing (default for a channel that never published).
    pub publishing: PublishState,
}

/// The broker's limits on session timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutLimits {
    /// Granted to a client that asks for none (or for 0).
    pub default: Duration,
    /// The most granted, advertised in `connection.start`.
    pub max: Duration,
}

/// A session the connection is attached to, as the connection keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    /// The session id.
    pub id: Uuid,
    /// The session's owner id: the connection's id from now on.
    pub owner: u64,
    /// The timeout granted.
    pub timeout: Duration,
    /// Whether this attachment resumed the session (false: it started it).
    pub resumed: bool,
    /// What the confirms the previous connection left unsent waited for (default for a new
    /// session): a resent duplicate's confirm waits for it too.
    pub barrier: Barrier,
}

impl Attached {
    /// The message the [`STATUS_QUEUE`] pseudo-queue holds for this attachment: the granted
    /// timeout, whether it resumed, and per channel of the session what a resumed client
    /// finds there — next delivery tag, unacknowledged tags, publishes processed, confirm and
    /// transactional mode, commits — as JSON (`content-type: application/json`), and the
    /// first three as headers for clients that do not parse JSON.
    pub fn status_message(&self, channels: &[ChannelStatus]) -> Message {
        let timeout_s = self.timeout.as_secs();
        let channels: serde_json::Map<String, serde_json::Value> = channels
            .iter()
            .map(|c| {
                let p = &c.publishing;
                (
                    c.channel.to_string(),
                    serde_json::json!({
                        "next_delivery_tag": c.next_delivery_tag,
                        "unacked": c.unacked,
                        "publishes_processed": p.published,
                        "confirm": p.confirming(),
                        "transactional": p.transactional,
                        "commits": p.commits,
                    }),
                )
            })
            .collect();
        let body = serde_json::json!({
            "session": self.id.to_string(),
            "timeout_s": timeout_s,
            "resumed": self.resumed,
            "channels": channels,
        });
        let mut headers = FieldTable::default();
        headers.insert(
            "qpid.session".into(),
            AMQPValue::LongString(self.id.to_string().as_str().into()),
        );
        headers.insert(
            TIMEOUT_PROPERTY.into(),
            AMQPValue::LongLongInt(i64::try_from(timeout_s).unwrap_or(i64::MAX)),
        );
        headers.insert(
            "qpid.session.resumed".into(),
            AMQPValue::Boolean(self.resumed),
        );
        Message::authored(
            ShortString::from(""),
            ShortString::from(STATUS_QUEUE),
            Properties::default()
                .with_content_type(ShortString::from("application/json"))
                .with_headers(headers),
            Bytes::from(body.to_string()),
        )
    }
}

/// A session that ended: what it owned goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// The session id.
    pub id: Uuid,
    /// The session's owner id.
    pub owner: u64,
    /// The vhost its connections used (none if none opened one).
    pub vhost: Option<String>,
}

/// A session as the admin API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// The session id.
    pub id: Uuid,
    /// Its user.
    pub user: String,
    /// Its granted timeout.
    pub timeout: Duration,
    /// A connection is attached to it.
    pub attached: bool,
}

/// A session this member let go of ([`Sessions::leave`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Left {
    /// It waited for a resume: what it owned goes now.
    Detached(Ended),
    /// A connection is still attached to it (the cluster moved it while this member had not
    /// yet seen that connection's end committed): the connection is closed, and its end
    /// releases what the session owned.
    Attached {
        /// The session's owner id, the connection's id.
        owner: u64,
    },
}

#[derive(Debug)]
struct Session {
    owner: u64,
    user: String,
    vhost: Option<String>,
    timeout: Duration,
    /// `None` while a connection is attached.
    detached_since: Option<Instant>,
    /// The publishing of its channels that no connection has open.
    publishing: HashMap<u16, PublishState>,
    /// What its last connection's unsent confirms waited for.
    barrier: Barrier,
}

impl Session {
    /// A session with nothing kept yet, attached to connection `owner`.
    fn attached(owner: u64, user: &str, timeout: Duration) -> Session {
        Session {
            owner,
            user: user.to_owned(),
            vhost: None,
            timeout,
            detached_since: None,
            publishing: HashMap::new(),
            barrier: Barrier::default(),
        }
    }

    fn expired(&self, now: Instant) -> bool {
        self.detached_since
            .is_some_and(|since| now.saturating_duration_since(since) >= self.timeout)
    }
}

/// Every session of this broker, attached or waiting for a resume.
#[derive(Debug)]
pub struct Sessions {
    limits: TimeoutLimits,
    sessions: Mutex<HashMap<Uuid, Session>>,
}

impl Sessions {
    /// An empty registry granting timeouts within `limits`.
    pub fn new(limits: TimeoutLimits) -> Sessions {
        Sessions {
            limits,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// The most this broker grants (advertised in `connection.start`).
    pub fn max_timeout(&self) -> Duration {
        self.limits.max
    }

    /// The timeout granted to a client that asks for `timeout_s` seconds (`None` or 0: the
    /// default), within the maximum.
    pub fn grant(&self, timeout_s: Option<u64>) -> Duration {
        match timeout_s {
            None | Some(0) => self.limits.default,
            Some(s) => Duration::from_secs(s),
        }
        .min(self.limits.max)
    }

    /// Opens session `id` for `user` on connection `conn` (its owner id from now on).
    pub fn start(
        &self,
        id: Uuid,
        timeout_s: Option<u64>,
        user: &str,
        conn: u64,
    ) -> Result<Attached, SessionError> {
        let mut sessions = self.sessions.lock();
        if sessions.contains_key(&id) {
            return Err(SessionError::new(
                codes::RESOURCE_LOCKED,
                format!(
                    "session {id} exists already: resume it with {RESUME_PROPERTY}, or start one with a new id"
                ),
            ));
        }
        let timeout = self.grant(timeout_s);
        sessions.insert(id, Session::attached(conn, user, timeout));
        Ok(Attached {
            id,
            owner: conn,
            timeout,
            resumed: false,
            barrier: Barrier::default(),
        })
    }

    /// Resumes session `id` for `user` at `now`: the connection takes the session's owner id.
    pub fn resume(&self, id: Uuid, user: &str, now: Instant) -> Result<Attached, SessionError> {
        let mut sessions = self.sessions.lock();
        let Some(s) = sessions.get_mut(&id).filter(|s| !s.expired(now)) else {
            return Err(SessionError::new(
                codes::NOT_FOUND,
                format!("no session {id} on this broker: it never existed here, ended, or expired"),
            ));
        };
        if s.user != user {
            return Err(SessionError::new(
                codes::ACCESS_REFUSED,
                format!("session {id} belongs to another user"),
            ));
        }
        if s.detached_since.is_none() {
            return Err(SessionError::new(
                codes::RESOURCE_LOCKED,
                format!("session {id} is attached to another connection"),
            ));
        }
        s.detached_since = None;
        Ok(Attached {
            id,
            owner: s.owner,
            timeout: s.timeout,
            resumed: true,
            barrier: s.barrier,
        })
    }

    /// Takes over session `id` that another cluster member held (or this member before a
    /// restart), as the cluster's session directory committed it to this member: its
    /// identity and timeout carry over, the state the other member kept does not — the
    /// resumed session starts with no channels (`docs/sessions.md` §2). Connection `conn`
    /// is its owner id from now on.
    pub fn adopt(&self, id: Uuid, user: &str, timeout: Duration, conn: u64) -> Attached {
        self.sessions
            .lock()
            .insert(id, Session::attached(conn, user, timeout));
        Attached {
            id,
            owner: conn,
            timeout,
            resumed: true,
            barrier: Barrier::default(),
        }
    }

    /// Every session of this broker, for the admin API.
    pub fn list(&self) -> Vec<SessionInfo> {
        self.sessions
            .lock()
            .iter()
            .map(|(id, s)| SessionInfo {
                id: *id,
                user: s.user.clone(),
                timeout: s.timeout,
                attached: s.detached_since.is_none(),
            })
            .collect()
    }

    /// Whether this broker holds session `id`'s state.
    pub fn contains(&self, id: Uuid) -> bool {
        self.sessions.lock().contains_key(&id)
    }

    /// Whether no connection of this broker is attached to session `id` (held detached
    /// here, or not held here at all).
    pub fn has_no_connection(&self, id: Uuid) -> bool {
        self.sessions
            .lock()
            .get(&id)
            .is_none_or(|s| s.detached_since.is_some())
    }

    /// Whether this broker holds session `id` and no connection is attached to it.
    pub fn is_detached(&self, id: Uuid) -> bool {
        self.sessions
            .lock()
            .get(&id)
            .is_some_and(|s| s.detached_since.is_some())
    }

    /// Session `id` is no longer this member's (another took it over, or the cluster ended
    /// it): removed, and returned for the caller to release what it owned.
    pub fn leave(&self, id: Uuid) -> Option<Left> {
        let s = self.sessions.lock().remove(&id)?;
        Some(match s.detached_since {
            Some(_) => Left::Detached(Ended {
                id,
                owner: s.owner,
                vhost: s.vhost,
            }),
            None => Left::Attached { owner: s.owner },
        })
    }

    /// The session's connection opens `vhost`: a session lives in one vhost, so a resume
    /// that opens another is refused (`Err` with the session's).
    pub fn open_vhost(&self, id: Uuid, vhost: &str) -> Result<(), SessionError> {
        let mut sessions = self.sessions.lock();
        let Some(s) = sessions.get_mut(&id) else {
            return Ok(());
        };
        match &s.vhost {
            Some(v) if v != vhost => Err(SessionError::new(
                codes::NOT_ALLOWED,
                format!("session {id} lives in vhost '{v}', not '{vhost}'"),
            )),
            Some(_) => Ok(()),
            None => {
                s.vhost = Some(vhost.to_owned());
                Ok(())
            }
        }
    }

    /// The session's connection is gone at `now`: kept for its timeout when `keep`, else
    /// ended (returned, for the caller to release what it owned). `barrier` is what the
    /// confirms it could not send waited for.
    pub fn detach(&self, id: Uuid, keep: bool, now: Instant, barrier: Barrier) -> Option<Ended> {
        let mut sessions = self.sessions.lock();
        if keep {
            if let Some(s) = sessions.get_mut(&id) {
                s.detached_since = Some(now);
                s.barrier = s.barrier.max(barrier);
            }
            return None;
        }
        sessions.remove(&id).map(|s| Ended {
            id,
            owner: s.owner,
            vhost: s.vhost,
        })
    }

    /// Channel `channel` of session `id` leaves its connection open in the session (the
    /// connection is going, the session stays): its publishing waits for the next one.
    pub fn keep_channel(&self, id: Uuid, channel: u16, publishing: PublishState) {
        if let Some(s) = self.sessions.lock().get_mut(&id) {
            s.publishing.insert(channel, publishing);
        }
    }

    /// Channel `channel` of session `id` is opened again: its publishing as it was left
    /// (default for a channel the session never had).
    pub fn take_channel(&self, id: Uuid, channel: u16) -> PublishState {
        self.sessions
            .lock()
            .get_mut(&id)
            .and_then(|s| s.publishing.remove(&channel))
            .unwrap_or_default()
    }

    /// The publishing of session `id`'s channels that no connection has open, by channel.
    pub fn kept_channels(&self, id: Uuid) -> Vec<(u16, PublishState)> {
        self.sessions
            .lock()
            .get(&id)
            .map(|s| s.publishing.iter().map(|(c, p)| (*c, p.clone())).collect())
            .unwrap_or_default()
    }

    /// Removes and returns the sessions whose timeout ran out by `now` without a resume.
    pub fn expire(&self, now: Instant) -> Vec<Ended> {
        let mut sessions = self.sessions.lock();
        let expired: Vec<Uuid> = sessions
            .iter()
            .filter(|(_, s)| s.expired(now))
            .map(|(id, _)| *id)
            .collect();
        expired
            .into_iter()
            .filter_map(|id| sessions.remove(&id).map(|s| (id, s)))
            .map(|(id, s)| Ended {
                id,
                owner: s.owner,
                vhost: s.vhost,
            })
            .collect()
    }

    /// Whether a session with owner id `owner` exists (attached or not): what it owns lives.
    pub fn owns(&self, owner: u64) -> bool {
        self.sessions.lock().values().any(|s| s.owner == owner)
    }

    /// How many sessions exist, and how many of them wait without a connection.
    pub fn counts(&self) -> (usize, usize) {
        let sessions = self.sessions.lock();
        let detached = sessions
            .values()
            .filter(|s| s.detached_since.is_some())
            .count();
        (sessions.len(), detached)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> TimeoutLimits {
        TimeoutLimits {
            default: Duration::from_secs(60),
            max: Duration::from_secs(300),
        }
    }

    fn props(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    const ID: &str = "6f1c4f9e-2b7d-4c53-9a51-0d2f1e3b8a77";

    #[test]
    fn client_properties_name_a_start_a_resume_or_nothing() {
        let id = Uuid::parse_str(ID).unwrap();
        assert_eq!(parse_request(&FieldTable::default()), Ok(None));
        assert_eq!(
            parse_request(&props(&[
                (START_PROPERTY, AMQPValue::LongString(ID.into())),
                (TIMEOUT_PROPERTY, AMQPValue::ShortInt(30)),
            ])),
            Ok(Some(SessionRequest::Start {
                id,
                timeout_s: Some(30)
            }))
        );
        assert_eq!(
            parse_request(&props(&[
                (START_PROPERTY, AMQPValue::LongString(ID.into())),
                (TIMEOUT_PROPERTY, AMQPValue::LongString("45".into())),
            ])),
            Ok(Some(SessionRequest::Start {
                id,
                timeout_s: Some(45)
            })),
            "lapin sends only strings"
        );
        assert_eq!(
            parse_request(&props(&[(
                RESUME_PROPERTY,
                AMQPValue::LongString(ID.into())
            )])),
            Ok(Some(SessionRequest::Resume { id }))
        );
    }

    #[test]
    fn malformed_session_properties_are_refused_with_530_saying_what_is_wrong() {
        let refused = |p: FieldTable, says: &str| {
            let e = parse_request(&p).unwrap_err();
            assert_eq!(e.code, codes::NOT_ALLOWED);
            assert!(e.text.contains(says), "{e}");
        };
        refused(
            props(&[(START_PROPERTY, AMQPValue::LongString("nope".into()))]),
            "is not a UUID",
        );
        refused(
            props(&[
                (START_PROPERTY, AMQPValue::LongString(ID.into())),
                (RESUME_PROPERTY, AMQPValue::LongString(ID.into())),
            ]),
            "exclude each other",
        );
        refused(
            props(&[
                (START_PROPERTY, AMQPValue::LongString(ID.into())),
                (TIMEOUT_PROPERTY, AMQPValue::LongInt(-1)),
            ]),
            "integer number of seconds",
        );
        refused(
            props(&[(RESUME_PROPERTY, AMQPValue::Boolean(true))]),
            "must be a string",
        );
    }

    #[test]
    fn a_session_is_granted_at_most_the_maximum_and_the_default_when_it_asks_none() {
        let s = Sessions::new(limits());
        let a = |n: u128| Uuid::from_u128(n);
        assert_eq!(
            s.start(a(1), Some(3600), "u", 1).unwrap().timeout,
            limits().max
        );
        assert_eq!(
            s.start(a(2), None, "u", 2).unwrap().timeout,
            limits().default
        );
        assert_eq!(
            s.start(a(3), Some(0), "u", 3).unwrap().timeout,
            limits().default
        );
        assert_eq!(
            s.start(a(4), Some(5), "u", 4).unwrap().timeout,
            Duration::from_secs(5)
        );
        assert_eq!(
            s.start(a(4), None, "u", 5).unwrap_err().code,
            codes::RESOURCE_LOCKED,
            "an id is never reused"
        );
    }

    #[test]
    fn a_kept_session_resumes_once_with_its_owner_until_its_timeout() {
        let s = Sessions::new(limits());
        let id = Uuid::from_u128(7);
        let t0 = Instant::now();
        s.start(id, Some(10), "alice", 42).unwrap();
        assert_eq!(
            s.resume(id, "alice", t0).unwrap_err().code,
            codes::RESOURCE_LOCKED,
            "attached to a live connection"
        );
        assert_eq!(s.detach(id, true, t0, Barrier::default()), None);
        assert!(s.owns(42));
        assert_eq!(
            s.resume(id, "bob", t0).unwrap_err().code,
            codes::ACCESS_REFUSED
        );
        let back = s.resume(id, "alice", t0 + Duration::from_secs(9)).unwrap();
        assert_eq!((back.owner, back.resumed), (42, true));
        s.detach(id, true, t0 + Duration::from_secs(9), Barrier::default());
        let late = t0 + Duration::from_secs(19);
        assert_eq!(
            s.resume(id, "alice", late).unwrap_err().code,
            codes::NOT_FOUND
        );
        assert_eq!(
            s.expire(late),
            vec![Ended {
                id,
                owner: 42,
                vhost: None
            }]
        );
        assert!(!s.owns(42));
    }

    #[test]
    fn a_session_not_kept_ends_at_once_with_its_vhost() {
        let s = Sessions::new(limits());
        let id = Uuid::from_u128(8);
        s.start(id, None, "u", 5).unwrap();
        s.open_vhost(id, "/").unwrap();
        assert_eq!(
            s.open_vhost(id, "other").unwrap_err().code,
            codes::NOT_ALLOWED
        );
        assert_eq!(
            s.detach(id, false, Instant::now(), Barrier::default()),
            Some(Ended {
                id,
                owner: 5,
                vhost: Some("/".into())
            })
        );
        assert_eq!(s.counts(), (0, 0));
        assert_eq!(
            s.resume(id, "u", Instant::now()).unwrap_err().code,
            codes::NOT_FOUND
        );
    }

    #[test]
    fn a_kept_channels_publishing_and_the_latest_barrier_wait_for_the_next_connection() {
        let s = Sessions::new(limits());
        let id = Uuid::from_u128(9);
        let t0 = Instant::now();
        s.start(id, None, "u", 1).unwrap();
        let mut p = PublishState {
            published: 5,
            confirm_base: Some(1),
            ..PublishState::default()
        };
        p.record_nack(3);
        s.keep_channel(id, 2, p.clone());
        let at = |journal_seq, replicated| Barrier {
            journal_seq,
            replicated,
        };
        s.detach(id, true, t0, at(10, 4));
        let back = s.resume(id, "u", t0).unwrap();
        assert_eq!(back.barrier, at(10, 4));
        assert_eq!(s.kept_channels(id), vec![(2, p.clone())]);
        let taken = s.take_channel(id, 2);
        assert_eq!(taken, p);
        assert_eq!(
            taken.confirm_of(4),
            Some((3, false)),
            "nacked the first time"
        );
        assert_eq!(taken.confirm_of(5), Some((4, true)));
        assert!(taken.is_duplicate(5) && !taken.is_duplicate(6));
        assert_eq!(s.take_channel(id, 2), PublishState::default(), "taken once");
        s.detach(id, true, t0, at(7, 9));
        assert_eq!(
            s.resume(id, "u", t0).unwrap().barrier,
            at(10, 9),
            "a barrier only grows"
        );
    }

    #[test]
    fn a_channel_remembers_only_its_most_recent_nacks() {
        let mut p = PublishState::default();
        for n in 1..=(NACK_MEMORY as u64 + 10) {
            p.record_nack(n);
        }
        assert_eq!(p.nacks.len(), NACK_MEMORY);
        assert_eq!(p.nacks.front(), Some(&11));
    }
}
