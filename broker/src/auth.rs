//! The user store and SASL mechanisms PLAIN and AMQPLAIN.

use crate::config::UserConfig;
use amq_protocol::types::{AMQPValue, FieldTable};
use parking_lot::RwLock;
use std::collections::BTreeMap;
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

/// A user's password as stored: RabbitMQ's `rabbit_password_hashing_sha256`, i.e.
/// SHA-256(salt ‖ password) with a 4-byte salt. Plaintext passwords from the config file are
/// hashed when loaded, so one representation serves login, export and import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswordHash {
    salt: [u8; 4],
    digest: [u8; 32],
}

/// The only hashing algorithm accepted on import (RabbitMQ's default since 3.6).
pub const HASHING_ALGORITHM: &str = "rabbit_password_hashing_sha256";

impl PasswordHash {
    /// Hashes `password` with a fresh salt.
    pub fn new(password: &str) -> Self {
        Self::with_salt(fresh_salt(), password)
    }

    fn with_salt(salt: [u8; 4], password: &str) -> Self {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(salt);
        h.update(password.as_bytes());
        Self {
            salt,
            digest: h.finalize().into(),
        }
    }

    /// A hash no password matches: RabbitMQ's empty `password_hash` (a user that cannot log
    /// in with a password).
    pub fn locked() -> Self {
        Self {
            salt: [0; 4],
            digest: [0; 32],
        }
    }

    fn is_locked(&self) -> bool {
        self.salt == [0; 4] && self.digest == [0; 32]
    }

    /// Parses RabbitMQ's `password_hash`: base64 of salt (4 bytes) followed by the digest.
    pub fn from_base64(text: &str) -> Option<Self> {
        use base64::Engine;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .ok()?;
        if raw.len() != 36 {
            return None;
        }
        let mut salt = [0u8; 4];
        salt.copy_from_slice(&raw[..4]);
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&raw[4..]);
        Some(Self { salt, digest })
    }

    /// The `password_hash` field of a definitions export.
    pub fn to_base64(&self) -> String {
        use base64::Engine;
        if self.is_locked() {
            return String::new();
        }
        let mut raw = Vec::with_capacity(36);
        raw.extend_from_slice(&self.salt);
        raw.extend_from_slice(&self.digest);
        base64::engine::general_purpose::STANDARD.encode(raw)
    }

    /// Whether `password` is the one hashed.
    pub fn matches(&self, password: &str) -> bool {
        !self.is_locked()
            && constant_time_eq(&Self::with_salt(self.salt, password).digest, &self.digest)
    }
}

/// Four salt bytes that differ between users and runs. Not a secret: the salt only keeps equal
/// passwords from having equal hashes.
fn fresh_salt() -> [u8; 4] {
    use sha2::Digest;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = sha2::Sha256::new();
    h.update(COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.update(nanos.to_le_bytes());
    let out: [u8; 32] = h.finalize().into();
    [out[0], out[1], out[2], out[3]]
}

/// A stored user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRecord {
    /// Login name.
    pub name: String,
    /// Salted password hash.
    pub password: PasswordHash,
    /// Management tags: `administrator` (everything), `monitoring` (read-only admin API).
    pub tags: Vec<String>,
    /// Only accepted from loopback addresses.
    pub loopback_only: bool,
}

/// What a user may do in one vhost: RabbitMQ's configure/write/read regular expressions.
/// Today only their existence is enforced (a user with no entry cannot open the vhost); the
/// regexes are stored and exported, and enforced by issue 4.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permission {
    /// Resources the user may declare and delete.
    pub configure: String,
    /// Resources the user may publish to or bind from.
    pub write: String,
    /// Resources the user may consume from or bind to.
    pub read: String,
}

impl Permission {
    /// `.*` for all three: what a config-file user gets on each vhost it may open.
    pub fn full() -> Self {
        Self {
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }
    }
}

#[derive(Debug, Default)]
struct Users {
    users: BTreeMap<String, UserRecord>,
    /// (user, vhost) → permission.
    permissions: BTreeMap<(String, String), Permission>,
}

/// Users allowed to log in and their permissions; changed at run time by the admin API.
/// Reads (logins) take a shared lock; the lock is never held across an await.
#[derive(Debug, Default)]
pub struct UserStore {
    inner: RwLock<Users>,
}

/// A logged-in user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Name.
    pub name: String,
    /// Vhosts it may open (those it has a permission on when it logged in).
    pub vhosts: Vec<String>,
}

impl User {
    /// Whether the user may open `vhost`.
    pub fn may_open(&self, vhost: &str) -> bool {
        self.vhosts.iter().any(|v| v == vhost)
    }
}

/// The mechanisms offered in connection.start on every connection.
pub const MECHANISMS: &str = "PLAIN AMQPLAIN";

/// The mechanism that logs in as the subject CN of a verified TLS client certificate;
/// offered only on TLS connections that presented one.
pub const MECHANISM_EXTERNAL: &str = "EXTERNAL";

impl UserStore {
    /// A store of the configured users. A user with no `vhosts` gets full permissions on
    /// every vhost in `vhosts`; otherwise on the ones it lists.
    pub fn new(users: Vec<UserConfig>, vhosts: &[String]) -> Self {
        let store = Self::default();
        {
            let mut inner = store.inner.write();
            for u in users {
                let allowed = if u.vhosts.is_empty() {
                    vhosts.to_vec()
                } else {
                    u.vhosts.clone()
                };
                for v in allowed {
                    inner
                        .permissions
                        .insert((u.name.clone(), v), Permission::full());
                }
                inner.users.insert(
                    u.name.clone(),
                    UserRecord {
                        password: PasswordHash::new(&u.password),
                        name: u.name,
                        tags: u.tags,
                        loopback_only: u.loopback_only,
                    },
                );
            }
        }
        store
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
        self.check_password(&name, &password, peer)?;
        Ok(self.logged_in(name))
    }

    /// SASL EXTERNAL: `name` is the common name of a client certificate that the TLS layer
    /// verified, so no password is checked; the user must still exist (RabbitMQ's rule) and
    /// its loopback restriction still holds.
    pub fn authenticate_external(&self, name: &str, peer: IpAddr) -> Result<User, AuthError> {
        let loopback_only = self
            .inner
            .read()
            .users
            .get(name)
            .map(|u| u.loopback_only)
            .ok_or_else(|| AuthError::Refused(name.to_owned()))?;
        if loopback_only && !peer.is_loopback() {
            return Err(AuthError::LoopbackOnly(name.to_owned()));
        }
        Ok(self.logged_in(name.to_owned()))
    }

    /// The logged-in view of a user: the vhosts it has a permission on now.
    fn logged_in(&self, name: String) -> User {
        let inner = self.inner.read();
        let vhosts = inner
            .permissions
            .keys()
            .filter(|(u, _)| *u == name)
            .map(|(_, v)| v.clone())
            .collect();
        User { name, vhosts }
    }

    /// Checks a name and password (AMQP login and the admin API's basic auth); returns the
    /// user's record.
    pub fn check_password(
        &self,
        name: &str,
        password: &str,
        peer: IpAddr,
    ) -> Result<UserRecord, AuthError> {
        let inner = self.inner.read();
        let user = inner
            .users
            .get(name)
            .filter(|u| u.password.matches(password))
            .ok_or_else(|| AuthError::Refused(name.to_owned()))?;
        if user.loopback_only && !peer.is_loopback() {
            return Err(AuthError::LoopbackOnly(name.to_owned()));
        }
        Ok(user.clone())
    }

    /// All users, by name.
    pub fn users(&self) -> Vec<UserRecord> {
        self.inner.read().users.values().cloned().collect()
    }

    /// One user.
    pub fn user(&self, name: &str) -> Option<UserRecord> {
        self.inner.read().users.get(name).cloned()
    }

    /// Adds or replaces a user; returns true if it was new. Permissions are kept.
    pub fn put_user(&self, user: UserRecord) -> bool {
        self.inner
            .write()
            .users
            .insert(user.name.clone(), user)
            .is_none()
    }

    /// Removes a user and its permissions; returns whether it existed.
    pub fn delete_user(&self, name: &str) -> bool {
        let mut inner = self.inner.write();
        inner.permissions.retain(|(u, _), _| u != name);
        inner.users.remove(name).is_some()
    }

    /// All permissions as (user, vhost, permission).
    pub fn permissions(&self) -> Vec<(String, String, Permission)> {
        self.inner
            .read()
            .permissions
            .iter()
            .map(|((u, v), p)| (u.clone(), v.clone(), p.clone()))
            .collect()
    }

    /// Sets a user's permission on a vhost; returns true if it was new.
    pub fn set_permission(&self, user: &str, vhost: &str, p: Permission) -> bool {
        self.inner
            .write()
            .permissions
            .insert((user.to_owned(), vhost.to_owned()), p)
            .is_none()
    }

    /// Removes a user's permission on a vhost; returns whether it existed.
    pub fn clear_permission(&self, user: &str, vhost: &str) -> bool {
        self.inner
            .write()
            .permissions
            .remove(&(user.to_owned(), vhost.to_owned()))
            .is_some()
    }

    /// Removes every permission on a vhost (it was deleted).
    pub fn forget_vhost(&self, vhost: &str) {
        self.inner
            .write()
            .permissions
            .retain(|(_, v), _| v != vhost);
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
        let c = crate::config::Config::default();
        UserStore::new(c.users, &c.vhosts)
    }

    #[test]
    fn rabbitmq_password_hashes_are_accepted() {
        // A hash as RabbitMQ's `rabbitmqctl hash_password guest` would write it.
        let h = PasswordHash::with_salt([1, 2, 3, 4], "s3cret");
        let parsed = PasswordHash::from_base64(&h.to_base64()).unwrap();
        assert!(parsed.matches("s3cret"));
        assert!(!parsed.matches("guest"));
        assert!(PasswordHash::from_base64("not base64!").is_none());
        assert!(PasswordHash::from_base64("AAAA").is_none());
    }

    #[test]
    fn a_user_without_a_permission_cannot_open_the_vhost() {
        let s = store();
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert!(
            s.authenticate("PLAIN", b"\0guest\0guest", lo)
                .unwrap()
                .may_open("/")
        );
        s.clear_permission("guest", "/");
        assert!(
            !s.authenticate("PLAIN", b"\0guest\0guest", lo)
                .unwrap()
                .may_open("/")
        );
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
