//! The user store and SASL mechanisms PLAIN and AMQPLAIN.

use crate::config::UserConfig;
use amq_protocol::types::{AMQPValue, FieldTable};
use std::net::IpAddr;

/// Why a login was refused; the text goes into the ACCESS_REFUSED reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// The response could not be decoded for the mechanism.
    Malformed(&'static str),
    /// Unknown user or wrong password.
    Refused(String),
    /// The user may only connect from loopback.
    LoopbackOnly(String),
}

impl AuthError {
    /// Reply text in the words RabbitMQ uses, so people find it when they search.
    pub fn reply_text(&self, mechanism: &str) -> String {
        match self {
            AuthError::Malformed(why) => format!("ACCESS_REFUSED - {why}"),
            AuthError::Refused(_) => format!(
                "ACCESS_REFUSED - Login was refused using authentication mechanism {mechanism}. \
                 For details see the broker logfile."
            ),
            AuthError::LoopbackOnly(user) => {
                format!("ACCESS_REFUSED - User '{user}' can only connect via localhost")
            }
        }
    }
}

/// Users allowed to log in.
#[derive(Debug, Clone)]
pub struct UserStore {
    users: Vec<UserConfig>,
}

/// A logged-in user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Name.
    pub name: String,
    /// Vhosts it may open (empty = all).
    pub vhosts: Vec<String>,
}

impl User {
    /// Whether the user may open `vhost`.
    pub fn may_open(&self, vhost: &str) -> bool {
        self.vhosts.is_empty() || self.vhosts.iter().any(|v| v == vhost)
    }
}

/// The mechanisms offered in connection.start.
pub const MECHANISMS: &str = "PLAIN AMQPLAIN";

impl UserStore {
    /// A store of the configured users.
    pub fn new(users: Vec<UserConfig>) -> Self {
        Self { users }
    }

    /// Checks a start-ok response for `mechanism` from `peer`.
    pub fn authenticate(
        &self,
        mechanism: &str,
        response: &[u8],
        peer: IpAddr,
    ) -> Result<User, AuthError> {
        let (name, password) = match mechanism {
            "PLAIN" => parse_plain(response)?,
            "AMQPLAIN" => parse_amqplain(response)?,
            _ => return Err(AuthError::Malformed("unsupported mechanism")),
        };
        let user = self
            .users
            .iter()
            .find(|u| {
                u.name == name && constant_time_eq(u.password.as_bytes(), password.as_bytes())
            })
            .ok_or_else(|| AuthError::Refused(name.clone()))?;
        if user.loopback_only && !peer.is_loopback() {
            return Err(AuthError::LoopbackOnly(name));
        }
        Ok(User {
            name,
            vhosts: user.vhosts.clone(),
        })
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// PLAIN (RFC 4616): `authzid NUL authcid NUL passwd`.
fn parse_plain(response: &[u8]) -> Result<(String, String), AuthError> {
    let mut parts = response.split(|b| *b == 0);
    let (Some(_authz), Some(user), Some(pass), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::Malformed(
            "PLAIN response must be authzid NUL user NUL password",
        ));
    };
    let text = |b: &[u8]| {
        String::from_utf8(b.to_vec()).map_err(|_| AuthError::Malformed("credentials are not UTF-8"))
    };
    Ok((text(user)?, text(pass)?))
}

/// AMQPLAIN: a field table (without its length prefix) with LOGIN and PASSWORD.
fn parse_amqplain(response: &[u8]) -> Result<(String, String), AuthError> {
    let mut framed = Vec::with_capacity(response.len() + 4);
    framed.extend_from_slice(&(response.len() as u32).to_be_bytes());
    framed.extend_from_slice(response);
    let table: FieldTable = amq_protocol::types::parsing::parse_field_table(framed.as_slice())
        .map(|(_, t)| t)
        .map_err(|_| AuthError::Malformed("AMQPLAIN response is not a field table"))?;
    let get = |k: &str| match table.inner().get(k) {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_owned()),
        _ => None,
    };
    match (get("LOGIN"), get("PASSWORD")) {
        (Some(u), Some(p)) => Ok((u, p)),
        _ => Err(AuthError::Malformed(
            "AMQPLAIN response needs LOGIN and PASSWORD",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn store() -> UserStore {
        UserStore::new(crate::config::Config::default().users)
    }

    #[test]
    fn guest_logs_in_with_plain_from_loopback_only() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let remote = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(
            store()
                .authenticate("PLAIN", b"\0guest\0guest", lo)
                .unwrap()
                .name,
            "guest"
        );
        assert!(matches!(
            store().authenticate("PLAIN", b"\0guest\0guest", remote),
            Err(AuthError::LoopbackOnly(_))
        ));
        assert!(matches!(
            store().authenticate("PLAIN", b"\0guest\0nope", lo),
            Err(AuthError::Refused(_))
        ));
        assert!(matches!(
            store().authenticate("PLAIN", b"guest", lo),
            Err(AuthError::Malformed(_))
        ));
    }

    #[test]
    fn amqplain_reads_login_and_password() {
        // LOGIN:S"guest" PASSWORD:S"guest", as pika sends it.
        let mut t = Vec::new();
        for (k, v) in [("LOGIN", "guest"), ("PASSWORD", "guest")] {
            t.push(k.len() as u8);
            t.extend_from_slice(k.as_bytes());
            t.push(b'S');
            t.extend_from_slice(&(v.len() as u32).to_be_bytes());
            t.extend_from_slice(v.as_bytes());
        }
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(
            store().authenticate("AMQPLAIN", &t, lo).unwrap().name,
            "guest"
        );
    }
}
