//! The handshake: connection.start, start-ok (authentication), tune, tune-ok and open, up to
//! open-ok with the cluster's known-hosts. Only connection methods on channel 0 are allowed
//! until then.

use super::frames::ConnError;
use super::{ClientCaps, Connection, Phase};
use crate::amqp::frame::{self, FRAME_HEARTBEAT, FRAME_METHOD, RawFrame};
use crate::amqp::{AMQPClass, AMQPValue, FieldTable, codes, connection};
use crate::auth::permissions::Permissions;
use crate::auth::{AuthError, MECHANISM_EXTERNAL, MECHANISMS, Permission, User};
use crate::cluster::OpOutcome;
use crate::core::WiringOp;
use crate::proxy::link::LINK_USER;
use crate::session::directory::SessionOp;
use crate::session::{SessionError, SessionRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// A session start or resume in flight through the cluster's session directory: the
/// connection reads nothing more and sends no tune until it is committed.
pub(super) struct SessionWait {
    request: SessionRequest,
    /// The timeout the session has (granted to a start, recorded for a resume).
    timeout: Duration,
    outcome: oneshot::Receiver<OpOutcome>,
}

/// Resolves when the session the connection waits for is committed (or cannot be).
pub(super) async fn session_committed(wait: &mut Option<SessionWait>) -> Option<OpOutcome> {
    match wait {
        Some(w) => (&mut w.outcome).await.ok(),
        None => std::future::pending().await,
    }
}

impl Connection {
    pub(super) fn send_start(&mut self) {
        let mut caps = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            "per_consumer_qos",
            crate::session::CAPABILITY,
        ] {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(v.into());
        props.insert("product".into(), s("ringmq"));
        props.insert("version".into(), s(env!("CARGO_PKG_VERSION")));
        props.insert("platform".into(), s("Rust"));
        props.insert("information".into(), s("A clustered AMQP 0-9-1 broker"));
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        let max_timeout = self.broker.sessions().max_timeout().as_secs();
        props.insert(
            crate::session::TIMEOUT_PROPERTY.into(),
            AMQPValue::LongLongInt(i64::try_from(max_timeout).unwrap_or(i64::MAX)),
        );
        self.writer.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: props,
                mechanisms: self.mechanisms().into(),
                locales: "en_US".into(),
            })),
        );
    }

    /// PLAIN and AMQPLAIN always; EXTERNAL only on a TLS connection whose client presented a
    /// certificate the broker verified (as RabbitMQ's `rabbitmq_auth_mechanism_ssl`).
    pub(super) fn mechanisms(&self) -> String {
        match self.tls.as_ref().and_then(|t| t.external.as_ref()) {
            Some(_) => format!("{MECHANISMS} {MECHANISM_EXTERNAL}"),
            None => MECHANISMS.to_owned(),
        }
    }

    pub(super) fn on_handshake_frame(&mut self, frame: RawFrame) -> Result<(), ConnError> {
        if frame.kind == FRAME_HEARTBEAT {
            return Ok(());
        }
        if frame.kind != FRAME_METHOD || frame.channel != 0 {
            return Err(ConnError::new(
                codes::COMMAND_INVALID,
                "only connection methods are allowed before connection.open-ok",
            ));
        }
        let method = Self::parse_method(&frame, self.broker.config.max_table_depth)?;
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        let at = |mut e: ConnError| {
            e.class_id = class_id;
            e.method_id = method_id;
            e
        };
        match (self.phase, method) {
            (Phase::Start, AMQPClass::Connection(connection::AMQPMethod::StartOk(ok))) => {
                self.on_start_ok(ok).map_err(at)
            }
            (Phase::Tune, AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok))) => {
                self.on_tune_ok(ok).map_err(at)
            }
            (Phase::Open, AMQPClass::Connection(connection::AMQPMethod::Open(open))) => {
                self.on_open(open).map_err(at)
            }
            (_, AMQPClass::Connection(connection::AMQPMethod::Close(_))) => {
                self.writer.method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.close_reason = "client closed during the handshake".into();
                self.phase = Phase::Done;
                Ok(())
            }
            _ => Err(at(ConnError::new(
                codes::COMMAND_INVALID,
                "unexpected method during the handshake",
            ))),
        }
    }

    pub(super) fn on_start_ok(&mut self, ok: connection::StartOk) -> Result<(), ConnError> {
        if let Some(AMQPValue::FieldTable(caps)) = ok.client_properties.inner().get("capabilities")
        {
            let on = |k: &str| matches!(caps.inner().get(k), Some(AMQPValue::Boolean(true)));
            self.caps = ClientCaps {
                consumer_cancel_notify: on("consumer_cancel_notify"),
                connection_blocked: on("connection.blocked"),
                authentication_failure_close: on("authentication_failure_close"),
                recognises_redeliveries: on("ringmq.recognises_redeliveries"),
            };
        }
        let mechanism = ok.mechanism.as_str();
        if !self.mechanisms().split(' ').any(|m| m == mechanism) {
            return Err(ConnError::new(
                codes::COMMAND_INVALID,
                format!("unknown authentication mechanism '{mechanism}'"),
            ));
        }
        let external = self.tls.as_ref().and_then(|t| t.external.as_deref());
        let link = self.link_login(mechanism, ok.response.as_bytes());
        self.link = matches!(link, Some(Ok(_)));
        let result = match (mechanism, external) {
            _ if link.is_some() => link.expect("checked"),
            (MECHANISM_EXTERNAL, Some(cn)) => {
                self.broker.users.authenticate_external(cn, self.peer.ip())
            }
            _ => self
                .broker
                .users
                .authenticate(mechanism, ok.response.as_bytes(), self.peer.ip()),
        };
        match result {
            Ok(user) => self.user = Some(user),
            Err(e) => {
                tracing::warn!(conn = self.id, peer = %self.peer, error = ?e, "login refused");
                let text = e.reply_text(mechanism);
                if self.caps.authentication_failure_close {
                    return Err(ConnError::new(codes::ACCESS_REFUSED, text));
                }
                // Without the capability, RabbitMQ just closes the socket.
                self.close_reason = text;
                self.phase = Phase::Done;
                return Ok(());
            }
        }
        if !self.link && self.attach_session(&ok.client_properties)? {
            // tune waits for the cluster to commit the session ([`SessionWait`]).
            return Ok(());
        }
        self.send_tune();
        Ok(())
    }

    fn send_tune(&mut self) {
        let c = &self.broker.config;
        self.writer.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: c.channel_max,
                frame_max: c.frame_max,
                heartbeat: c.heartbeat_s,
            })),
        );
        self.phase = Phase::Tune;
    }

    /// Starts or resumes the session the client-properties name (`docs/sessions.md`); a
    /// resumed session's connection takes its owner id. Refused with the code the session
    /// contract names (530 malformed, 404 unknown, 405 attached elsewhere or id taken, 403
    /// another user's). On a cluster the session directory decides, from any member: a
    /// start or resume is committed to it first (`Ok(true)`: the connection waits for that,
    /// and [`Connection::on_session_committed`] finishes the attach).
    fn attach_session(&mut self, props: &crate::amqp::FieldTable) -> Result<bool, ConnError> {
        let refused = |e: SessionError| ConnError::new(e.code, e.text);
        let Some(request) = crate::session::parse_request(props).map_err(refused)? else {
            return Ok(false);
        };
        let user = self.user_name();
        let sessions = self.broker.sessions();
        let Some(cluster) = self.broker.cluster().cloned() else {
            let attached = match request {
                SessionRequest::Start { id, timeout_s } => {
                    sessions.start(id, timeout_s, &user, self.id)
                }
                SessionRequest::Resume { id } => {
                    sessions.resume(id, &user, std::time::Instant::now())
                }
            }
            .map_err(refused)?;
            self.attached(attached);
            return Ok(false);
        };
        if let Some(reason) = cluster.not_ready_reason() {
            // Its session directory may be older than the session (a member replaying its
            // log after a restart): a 404 from it would end a session that lives, so it
            // answers as `connection.open` would — 320, try again or elsewhere.
            return Err(ConnError::new(
                codes::CONNECTION_FORCED,
                format!("this cluster member is not ready: {reason}"),
            ));
        }
        if cluster.is_draining(cluster.node_id()) {
            return Err(ConnError::new(
                codes::CONNECTION_FORCED,
                "this cluster member is being drained: resume the session on another",
            ));
        }
        let me = cluster.node_id().to_owned();
        let (op, timeout) = match request {
            SessionRequest::Start { id, timeout_s } => {
                let timeout = sessions.grant(timeout_s);
                let op = SessionOp::Start {
                    id: id.to_string(),
                    user,
                    timeout_s: timeout.as_secs(),
                    member: me,
                };
                (op, timeout)
            }
            SessionRequest::Resume { id } => {
                let record = cluster.session(&id.to_string());
                let record = crate::session::directory::attachable(
                    &id.to_string(),
                    record.as_ref(),
                    &user,
                    None,
                )
                .map_err(|e| ConnError::new(e.code, e.text))?
                .clone();
                let op = SessionOp::Attach {
                    id: id.to_string(),
                    user,
                    from: record.member,
                    to: me,
                };
                (op, Duration::from_secs(record.timeout_s))
            }
        };
        self.session_wait = Some(SessionWait {
            request,
            timeout,
            outcome: cluster.submit(&self.vhost_name, WiringOp::Session(op)),
        });
        Ok(true)
    }

    /// The cluster committed this connection's session start or resume (or could not): the
    /// session attaches here — with the state this member kept of it, or, taken over from
    /// another member, as that member's resumed session starts (`docs/sessions.md` §2) —
    /// and the handshake goes on with tune; or the connection is refused with the reason.
    pub(super) fn on_session_committed(&mut self, outcome: Option<OpOutcome>) {
        let Some(wait) = self.session_wait.take() else {
            return;
        };
        let committed = match outcome {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => {
                if ![codes::NOT_FOUND, codes::RESOURCE_LOCKED].contains(&e.code) {
                    self.detach_uncertain(&wait.request);
                }
                Err(ConnError::new(e.code, e.text))
            }
            None => Err(ConnError::new(
                codes::CONNECTION_FORCED,
                "the cluster layer stopped before the session was committed",
            )),
        };
        let user = self.user_name();
        let sessions = self.broker.sessions();
        let attached = committed.and_then(|()| {
            let refused = |e: SessionError| ConnError::new(e.code, e.text);
            match wait.request {
                SessionRequest::Start { id, .. } => sessions
                    .start(id, Some(wait.timeout.as_secs()), &user, self.id)
                    .map_err(refused),
                SessionRequest::Resume { id } if sessions.contains(id) => sessions
                    .resume(id, &user, std::time::Instant::now())
                    .map_err(refused),
                SessionRequest::Resume { id } => {
                    Ok(sessions.adopt(id, &user, wait.timeout, self.id))
                }
            }
        });
        match attached {
            Ok(attached) => {
                self.attached(attached);
                self.send_tune();
            }
            Err(e) => self.connection_error(ConnError {
                class_id: 10,
                method_id: 11,
                ..e
            }),
        }
    }

    /// The cluster could not say whether this connection's session start or resume was
    /// committed (its leader went with the answer): it may have been, attaching the session
    /// to this member with no connection here — and then every resume of it was refused
    /// with 405 for good (a failover client gave the session up after 30 s in CI's
    /// `kill-primary`, B19 in docs/reliability.md). A detach from this member undoes that,
    /// and changes nothing if the session is elsewhere.
    fn detach_uncertain(&self, request: &SessionRequest) {
        let id = match request {
            SessionRequest::Start { id, .. } | SessionRequest::Resume { id } => *id,
        };
        if let Some(cluster) = self.broker.cluster() {
            self.broker.commit_session(SessionOp::Detach {
                id: id.to_string(),
                member: cluster.node_id().to_owned(),
            });
        }
    }

    fn user_name(&self) -> String {
        self.user
            .as_ref()
            .expect("authenticated first")
            .name
            .clone()
    }

    /// The connection is attached to a session: it takes the session's owner id.
    fn attached(&mut self, attached: crate::session::Attached) {
        if attached.owner != self.id {
            self.broker.rekey_connection(self.id, attached.owner);
            self.id = attached.owner;
        }
        tracing::info!(conn = self.id, session = %attached.id, resumed = attached.resumed, timeout_s = attached.timeout.as_secs(), "session attached");
        // A session that started on another member publishes as that member; one that
        // started here as this member, which is what `None` says (without a lookup per
        // publish).
        self.publish_origin = self.broker.cluster().and_then(|c| {
            let origin = c.session(&attached.id.to_string())?.origin;
            (!origin.is_empty() && origin != c.node_id()).then(|| Arc::from(origin))
        });
        self.forwards.resend_when_moving();
        self.session = Some(attached);
    }

    /// A login as [`LINK_USER`] on a cluster member: another member's link, which must
    /// present the password derived from the cluster secret. `None` for any other login.
    fn link_login(&self, mechanism: &str, response: &[u8]) -> Option<Result<User, AuthError>> {
        let cluster = self.broker.cluster()?;
        if mechanism != "PLAIN" {
            return None;
        }
        let mut parts = response.split(|&b| b == 0).skip(1);
        let (user, password) = (parts.next()?, parts.next()?);
        if user != LINK_USER.as_bytes() {
            return None;
        }
        let expected = cluster.link_password().as_bytes();
        // Constant time in the password's content: no early exit on the first difference.
        let same = password.len() == expected.len()
            && password
                .iter()
                .zip(expected)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        Some(if same {
            Ok(User {
                name: LINK_USER.to_owned(),
                vhosts: self.broker.vhosts().into_iter().map(|(n, _)| n).collect(),
            })
        } else {
            Err(AuthError::Refused(LINK_USER.to_owned()))
        })
    }

    pub(super) fn on_tune_ok(&mut self, ok: connection::TuneOk) -> Result<(), ConnError> {
        let c = &self.broker.config;
        if ok.frame_max != 0 && (ok.frame_max < frame::FRAME_MIN_SIZE || ok.frame_max > c.frame_max)
        {
            return Err(ConnError::new(
                codes::SYNTAX_ERROR,
                format!(
                    "frame_max={} outside the allowed range {}..={}",
                    ok.frame_max,
                    frame::FRAME_MIN_SIZE,
                    c.frame_max
                ),
            ));
        }
        if ok.channel_max > c.channel_max {
            return Err(ConnError::new(
                codes::NOT_ALLOWED,
                format!(
                    "channel_max={} is above the server's {}",
                    ok.channel_max, c.channel_max
                ),
            ));
        }
        self.frame_max = if ok.frame_max == 0 {
            c.frame_max
        } else {
            ok.frame_max
        };
        self.channel_max = if ok.channel_max == 0 {
            c.channel_max
        } else {
            ok.channel_max
        };
        self.heartbeat_s = ok.heartbeat;
        self.phase = Phase::Open;
        Ok(())
    }

    pub(super) fn on_open(&mut self, open: connection::Open) -> Result<(), ConnError> {
        if let Some(reason) = self.broker.cluster().and_then(|c| c.not_ready_reason()) {
            // A member that is not (yet) part of the majority's cluster serves nobody: what it
            // holds may be stale, and what it accepted could be rolled back.
            return Err(ConnError::new(
                codes::CONNECTION_FORCED,
                format!("this cluster member is not ready: {reason}"),
            ));
        }
        if !self.link
            && let Some(cluster) = self.broker.cluster()
            && cluster.is_draining(cluster.node_id())
        {
            // Being drained: its clients go to the others (links keep working: the queues
            // it holds move off over them).
            return Err(ConnError::new(
                codes::CONNECTION_FORCED,
                format!(
                    "this cluster member is being drained: connect to another (known-hosts: {})",
                    cluster.known_hosts().join(",")
                ),
            ));
        }
        let name = open.virtual_host.as_str();
        let user = self.user.as_ref().expect("authenticated before open");
        let vhost = self.broker.vhost(name).filter(|_| user.may_open(name));
        let Some(vhost) = vhost else {
            return Err(ConnError::new(
                codes::NOT_ALLOWED,
                format!("vhost {name} not found"),
            ));
        };
        if let Some(session) = &self.session {
            self.broker
                .sessions()
                .open_vhost(session.id, name)
                .map_err(|e| ConnError::new(e.code, e.text))?;
        }
        self.broker
            .connection_opened(self.id, self.peer, &user.name, name, self.link)
            .map_err(|limit| ConnError::new(codes::NOT_ALLOWED, limit))?;
        self.perms_generation = self.broker.users.permissions_generation();
        self.perms = if self.link {
            let full = Permissions::compile(LINK_USER, name, &Permission::full())
                .expect("the full permission compiles");
            Some(Arc::new(full))
        } else {
            self.broker.users.permissions_for(&user.name, name)
        };
        if self.link {
            vhost.lock().link_opened(self.id);
        }
        self.vhost = Some(vhost);
        self.vhost_name = name.to_owned();
        if let Some(session) = &self.session
            && self.broker.cluster().is_some()
        {
            self.broker
                .adopt_session_queues(name, &session.id.to_string(), self.id);
        }
        // open-ok's reserved shortstr is 0-8's known-hosts: a cluster fills it with the
        // members' AMQP addresses, the failover candidates.
        let known_hosts = self
            .broker
            .cluster()
            .map(|c| c.known_hosts().join(","))
            .unwrap_or_default();
        self.writer.open_ok(&known_hosts);
        self.phase = Phase::Running;
        tracing::info!(conn = self.id, peer = %self.peer, user = %user.name, vhost = name, "connection opened");
        if self.broker.publishers_blocked() {
            self.send_blocked(true);
        }
        Ok(())
    }
}
