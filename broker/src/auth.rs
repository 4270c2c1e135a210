//! The user store and SASL mechanisms PLAIN, AMQPLAIN and EXTERNAL.

pub mod password;
pub mod permissions;
pub mod ratelimit;

use crate::config::UserConfig;
use amq_protocol::types::{AMQPValue, FieldTable};
use parking_lot::{Mutex, RwLock};
pub use password::{HashError, PasswordHash};
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Why a login was refused; the text goes into the ACCESS_REFUSED reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// The response could not be decoded for the mechanism.
    Malformed(&'static str),
    /// Unknown user or wrong password.
    Refused(String),
    /// The user may only connect from loopback.
    LoopbackOnly(String),
    /// Too many failed logins from this address lately; the password was not checked.
    TooManyFailures {
        /// Seconds until the address may try again.
        retry_after_s: u64,
    },
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
            AuthError::TooManyFailures { retry_after_s } => format!(
                "ACCESS_REFUSED - too many failed logins from this address; \
                 try again in {retry_after_s} s"
            ),
        }
    }
}

/// A stored user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRecord {
    /// Login name.
    pub name: String,
    /// Stored password (PBKDF2, or RabbitMQ's hash when imported).
    pub password: PasswordHash,
    /// Management tags: `administrator` (everything), `monitoring` (read-only admin API).
    pub tags: Vec<String>,
    /// Only accepted from loopback addresses.
    pub loopback_only: bool,
}

/// What a user may do in one vhost: RabbitMQ's configure/write/read regular expressions
/// (enforced through [`permissions::Permissions`]; a user with no entry cannot open the
/// vhost at all).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// (user, vhost) → permission as given, and compiled.
    permissions: BTreeMap<(String, String), (Permission, Arc<permissions::Permissions>)>,
}

/// Users allowed to log in and their permissions; changed at run time by the admin API.
/// Reads (logins) take a shared lock; the lock is never held across an await, nor while a
/// password is hashed.
#[derive(Debug)]
pub struct UserStore {
    inner: RwLock<Users>,
    /// PBKDF2 iterations for passwords hashed here.
    iterations: u32,
    verified: VerifiedCache,
    limiter: ratelimit::LoginLimiter,
    /// Bumped by every permission change, so connections refresh their copy with one load.
    permissions_generation: AtomicU64,
}

/// Most remembered successful logins; the set is emptied when full (a bound, not an LRU:
/// the next login of each user pays one hash again).
const VERIFIED_CACHE_MAX: usize = 10_000;

/// Successful PBKDF2 checks, so that a client reconnecting with the right password pays one
/// HMAC (microseconds) instead of the full hash (~170 ms at the default cost). Entries are
/// HMAC-SHA256 under a key drawn at start and never stored, over (user, stored hash,
/// password): a changed password or hash never matches an old entry, and the set reveals
/// nothing without the key. Failed checks are not remembered.
struct VerifiedCache {
    key: ring::hmac::Key,
    seen: Mutex<HashSet<[u8; 32]>>,
}

impl std::fmt::Debug for VerifiedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifiedCache")
            .field("entries", &self.seen.lock().len())
            .finish_non_exhaustive()
    }
}

impl VerifiedCache {
    fn new() -> Self {
        let rng = ring::rand::SystemRandom::new();
        let key = ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &rng)
            .expect("the operating system's random source is available");
        Self {
            key,
            seen: Mutex::new(HashSet::new()),
        }
    }

    fn tag(&self, name: &str, hash: &PasswordHash, password: &str) -> [u8; 32] {
        let mut ctx = ring::hmac::Context::with_key(&self.key);
        for part in [name, &hash.encoded(), password] {
            ctx.update(&(part.len() as u64).to_be_bytes());
            ctx.update(part.as_bytes());
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    fn contains(&self, tag: &[u8; 32]) -> bool {
        self.seen.lock().contains(tag)
    }

    fn insert(&self, tag: [u8; 32]) {
        let mut seen = self.seen.lock();
        if seen.len() >= VERIFIED_CACHE_MAX {
            seen.clear();
        }
        seen.insert(tag);
    }
}

/// Runs a CPU-heavy step (a PBKDF2 check) without stalling the other tasks of the worker
/// thread: on the broker's multi-threaded runtime the worker hands its tasks to another
/// thread first. Elsewhere (a unit test, a current-thread runtime) it just runs.
fn cpu_heavy<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
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
    /// A store of the configured users, hashing plaintext passwords with PBKDF2 at
    /// `iterations`. A user with no `vhosts` gets full permissions on every vhost in `vhosts`;
    /// otherwise on the ones it lists. A user whose `password_hash` does not parse (the
    /// config check refuses that first) is locked, never let in.
    pub fn new(users: Vec<UserConfig>, vhosts: &[String], iterations: u32) -> Self {
        let store = Self {
            inner: RwLock::new(Users::default()),
            iterations,
            verified: VerifiedCache::new(),
            limiter: ratelimit::LoginLimiter::new(0, Duration::ZERO, 1),
            permissions_generation: AtomicU64::new(0),
        };
        {
            let mut inner = store.inner.write();
            for u in users {
                for (v, p) in u.vhost_permissions(vhosts) {
                    match permissions::Permissions::compile(&u.name, &v, &p) {
                        Ok(compiled) => {
                            inner
                                .permissions
                                .insert((u.name.clone(), v), (p, Arc::new(compiled)));
                        }
                        Err(e) => {
                            tracing::error!(user = %u.name, vhost = %v, error = %e, "permission not granted: invalid expression");
                        }
                    }
                }
                let password = u.stored_password(iterations).unwrap_or_else(|e| {
                    tracing::error!(user = %u.name, error = %e, "user locked: unusable password");
                    PasswordHash::locked()
                });
                inner.users.insert(
                    u.name.clone(),
                    UserRecord {
                        password,
                        name: u.name,
                        tags: u.tags,
                        loopback_only: u.loopback_only,
                    },
                );
            }
        }
        store
    }

    /// Refuses logins from an address after `max_failures` failures within `window`
    /// (0 = never), without checking the password, until the window has passed.
    pub fn with_login_limit(mut self, max_failures: u32, window: Duration) -> Self {
        self.limiter = ratelimit::LoginLimiter::new(max_failures, window, ratelimit::MAX_SOURCES);
        self
    }

    /// Runs one login attempt from `peer` under the failed-login limit: refused at once when
    /// the address is blocked, counted when it fails.
    fn limited<T>(
        &self,
        peer: IpAddr,
        attempt: impl FnOnce() -> Result<T, AuthError>,
    ) -> Result<T, AuthError> {
        if let Some(wait) = self.limiter.blocked_for(peer, Instant::now()) {
            return Err(AuthError::TooManyFailures {
                retry_after_s: wait.as_secs().max(1),
            });
        }
        let result = attempt();
        if result.is_err() {
            self.limiter.record_failure(peer, Instant::now());
        }
        result
    }

    /// Checks a start-ok response for `mechanism` from `peer`.
    pub fn authenticate(
        &self,
        mechanism: &str,
        response: &[u8],
        peer: IpAddr,
    ) -> Result<User, AuthError> {
        self.limited(peer, || {
            let (name, password) = match mechanism {
                "PLAIN" => parse_plain(response)?,
                "AMQPLAIN" => parse_amqplain(response)?,
                _ => return Err(AuthError::Malformed("unsupported mechanism")),
            };
            self.verify_password(&name, &password, peer)?;
            Ok(self.logged_in(name))
        })
    }

    /// SASL EXTERNAL: `name` is the common name of a client certificate that the TLS layer
    /// verified, so no password is checked; the user must still exist (RabbitMQ's rule) and
    /// its loopback restriction still holds.
    pub fn authenticate_external(&self, name: &str, peer: IpAddr) -> Result<User, AuthError> {
        self.limited(peer, || {
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
        })
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

    /// Checks a name and password (the admin API's basic auth), under the failed-login
    /// limit; returns the user's record.
    pub fn check_password(
        &self,
        name: &str,
        password: &str,
        peer: IpAddr,
    ) -> Result<UserRecord, AuthError> {
        self.limited(peer, || self.verify_password(name, password, peer))
    }

    fn verify_password(
        &self,
        name: &str,
        password: &str,
        peer: IpAddr,
    ) -> Result<UserRecord, AuthError> {
        let refused = || AuthError::Refused(name.to_owned());
        let user = self.user(name).ok_or_else(refused)?;
        let matches = if user.password.is_slow() {
            let tag = self.verified.tag(name, &user.password, password);
            self.verified.contains(&tag) || {
                let ok = cpu_heavy(|| user.password.matches(password));
                if ok {
                    self.verified.insert(tag);
                }
                ok
            }
        } else {
            user.password.matches(password)
        };
        if !matches {
            return Err(refused());
        }
        if user.loopback_only && !peer.is_loopback() {
            return Err(AuthError::LoopbackOnly(name.to_owned()));
        }
        Ok(user)
    }

    /// Hashes a new password the way this store does (PBKDF2 at the configured cost).
    pub fn hash_password(&self, password: &str) -> PasswordHash {
        cpu_heavy(|| PasswordHash::new(password, self.iterations))
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
        self.permissions_changed();
        inner.users.remove(name).is_some()
    }

    /// All permissions as (user, vhost, permission).
    pub fn permissions(&self) -> Vec<(String, String, Permission)> {
        self.inner
            .read()
            .permissions
            .iter()
            .map(|((u, v), (p, _))| (u.clone(), v.clone(), p.clone()))
            .collect()
    }

    /// A user's compiled permission on a vhost, if it has one.
    pub fn permissions_for(
        &self,
        user: &str,
        vhost: &str,
    ) -> Option<Arc<permissions::Permissions>> {
        self.inner
            .read()
            .permissions
            .get(&(user.to_owned(), vhost.to_owned()))
            .map(|(_, compiled)| compiled.clone())
    }

    /// Changes whenever any permission changes: a connection compares it (one atomic load)
    /// before trusting the copy it holds.
    pub fn permissions_generation(&self) -> u64 {
        self.permissions_generation.load(Ordering::Acquire)
    }

    fn permissions_changed(&self) {
        self.permissions_generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Sets a user's permission on a vhost; returns true if it was new. Refused when an
    /// expression does not compile.
    pub fn set_permission(
        &self,
        user: &str,
        vhost: &str,
        p: Permission,
    ) -> Result<bool, permissions::InvalidPattern> {
        let compiled = Arc::new(permissions::Permissions::compile(user, vhost, &p)?);
        let new = self
            .inner
            .write()
            .permissions
            .insert((user.to_owned(), vhost.to_owned()), (p, compiled))
            .is_none();
        self.permissions_changed();
        Ok(new)
    }

    /// Removes a user's permission on a vhost; returns whether it existed.
    pub fn clear_permission(&self, user: &str, vhost: &str) -> bool {
        let existed = self
            .inner
            .write()
            .permissions
            .remove(&(user.to_owned(), vhost.to_owned()))
            .is_some();
        self.permissions_changed();
        existed
    }

    /// Removes every permission on a vhost (it was deleted).
    pub fn forget_vhost(&self, vhost: &str) {
        self.inner
            .write()
            .permissions
            .retain(|(_, v), _| v != vhost);
        self.permissions_changed();
    }
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
        UserStore::new(c.users, &c.vhosts, password::MIN_ITERATIONS)
    }

    #[test]
    fn a_repeated_login_is_answered_from_the_cache_and_a_changed_password_is_not() {
        let s = store();
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let guest = s.user("guest").unwrap();
        let tag = s.verified.tag("guest", &guest.password, "guest");
        assert!(!s.verified.contains(&tag));
        s.check_password("guest", "guest", lo).unwrap();
        assert!(s.verified.contains(&tag), "a success is remembered");
        assert!(s.check_password("guest", "wrong", lo).is_err());
        assert_eq!(s.verified.seen.lock().len(), 1, "a failure is not");
        s.put_user(UserRecord {
            password: s.hash_password("new"),
            ..guest
        });
        assert!(s.check_password("guest", "guest", lo).is_err());
        assert!(s.check_password("guest", "new", lo).is_ok());
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
        assert!(s.permissions_for("guest", "/").is_none());
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
