//! RabbitMQ's per-user, per-vhost permissions: three regular expressions saying which
//! resources (queues and exchanges, by name) a user may *configure* (declare, delete), *write*
//! (publish to an exchange; be the destination of a binding) and *read* (consume, get and
//! purge from a queue; be the source of a binding).
//!
//! Matching follows RabbitMQ (`re:run` in `rabbit_auth_backend_internal`): the expression
//! matches anywhere in the name unless it is anchored, so `^app-` and `^app-.*$` are the
//! usual forms and `.*` allows everything; the empty string allows nothing. The default
//! exchange is checked under the name `amq.default`.
//!
//! Pure functions of (permission, access, resource): the connection calls
//! [`Permissions::check`] before handing a command to the vhost core.

use super::Permission;
use regex::Regex;
use thiserror::Error;

/// The kind of access a command needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Declare or delete.
    Configure,
    /// Publish to, or bind to (as destination).
    Write,
    /// Consume, get, purge, or bind from (as source).
    Read,
}

/// A named resource of a vhost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource<'a> {
    /// A queue.
    Queue(&'a str),
    /// An exchange (`""` is the default exchange).
    Exchange(&'a str),
}

impl Resource<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Resource::Queue(_) => "queue",
            Resource::Exchange(_) => "exchange",
        }
    }

    /// The name permissions are matched against: the default exchange is `amq.default`.
    fn name(&self) -> &str {
        match self {
            Resource::Exchange("") => "amq.default",
            Resource::Queue(n) | Resource::Exchange(n) => n,
        }
    }
}

/// A refused access, worded as RabbitMQ words it.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("access to {kind} '{name}' in vhost '{vhost}' refused for user '{user}'")]
pub struct Refused {
    /// `queue` or `exchange`.
    pub kind: &'static str,
    /// The resource's name as matched.
    pub name: String,
    /// The vhost.
    pub vhost: String,
    /// The user.
    pub user: String,
}

/// A permission regex that does not compile.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{field} is not a valid regular expression: {reason}")]
pub struct InvalidPattern {
    /// `configure`, `write` or `read`.
    pub field: &'static str,
    /// What the regex parser said.
    pub reason: String,
}

/// One compiled expression. `.*` and the empty string are recognised so that the common
/// grants cost no regex run on the publish path.
#[derive(Debug, Clone)]
enum Matcher {
    All,
    Nothing,
    Pattern(Regex),
}

impl Matcher {
    fn compile(field: &'static str, pattern: &str) -> Result<Self, InvalidPattern> {
        Ok(match pattern {
            "" => Matcher::Nothing,
            ".*" | "^.*$" | "^.*" => Matcher::All,
            p => Matcher::Pattern(Regex::new(p).map_err(|e| InvalidPattern {
                field,
                reason: e.to_string(),
            })?),
        })
    }

    fn allows(&self, name: &str) -> bool {
        match self {
            Matcher::All => true,
            Matcher::Nothing => false,
            Matcher::Pattern(re) => re.is_match(name),
        }
    }
}

/// A user's compiled permission on one vhost.
#[derive(Debug, Clone)]
pub struct Permissions {
    user: String,
    vhost: String,
    configure: Matcher,
    write: Matcher,
    read: Matcher,
}

impl Permissions {
    /// Compiles `p` for `user` on `vhost`.
    pub fn compile(user: &str, vhost: &str, p: &Permission) -> Result<Self, InvalidPattern> {
        Ok(Self {
            user: user.to_owned(),
            vhost: vhost.to_owned(),
            configure: Matcher::compile("configure", &p.configure)?,
            write: Matcher::compile("write", &p.write)?,
            read: Matcher::compile("read", &p.read)?,
        })
    }

    /// Whether the user may have `access` to `resource`.
    pub fn check(&self, access: Access, resource: Resource<'_>) -> Result<(), Refused> {
        let matcher = match access {
            Access::Configure => &self.configure,
            Access::Write => &self.write,
            Access::Read => &self.read,
        };
        if matcher.allows(resource.name()) {
            return Ok(());
        }
        Err(Refused {
            kind: resource.kind(),
            name: resource.name().to_owned(),
            vhost: self.vhost.clone(),
            user: self.user.clone(),
        })
    }
}

/// Checks that the three expressions of `p` compile (the admin API and the config file
/// refuse a permission that would not).
pub fn validate(p: &Permission) -> Result<(), InvalidPattern> {
    Permissions::compile("", "", p).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perms(configure: &str, write: &str, read: &str) -> Permissions {
        Permissions::compile(
            "app",
            "/",
            &Permission {
                configure: configure.into(),
                write: write.into(),
                read: read.into(),
            },
        )
        .unwrap()
    }

    #[test]
    fn full_access_allows_everything_and_empty_allows_nothing() {
        let p = perms(".*", ".*", "");
        assert!(p.check(Access::Configure, Resource::Queue("q")).is_ok());
        assert!(p.check(Access::Write, Resource::Exchange("")).is_ok());
        assert!(p.check(Access::Read, Resource::Queue("")).is_err());
        assert!(p.check(Access::Read, Resource::Queue("q")).is_err());
    }

    #[test]
    fn patterns_match_like_rabbitmq_unanchored_unless_anchored() {
        let p = perms("^app-", "app", "^(orders|amq\\.default)$");
        assert!(p.check(Access::Configure, Resource::Queue("app-1")).is_ok());
        assert!(
            p.check(Access::Configure, Resource::Queue("my-app-1"))
                .is_err()
        );
        assert!(p.check(Access::Write, Resource::Exchange("my-app")).is_ok());
        assert!(p.check(Access::Read, Resource::Queue("orders")).is_ok());
        assert!(p.check(Access::Read, Resource::Queue("orders2")).is_err());
        assert!(p.check(Access::Read, Resource::Exchange("")).is_ok());
    }

    #[test]
    fn a_refusal_reads_like_rabbitmqs() {
        let p = perms("", "", "");
        assert_eq!(
            p.check(Access::Write, Resource::Exchange(""))
                .unwrap_err()
                .to_string(),
            "access to exchange 'amq.default' in vhost '/' refused for user 'app'"
        );
        assert_eq!(
            p.check(Access::Read, Resource::Queue("q"))
                .unwrap_err()
                .to_string(),
            "access to queue 'q' in vhost '/' refused for user 'app'"
        );
    }

    #[test]
    fn an_invalid_pattern_names_its_field() {
        let bad = Permission {
            configure: ".*".into(),
            write: "(".into(),
            read: ".*".into(),
        };
        assert_eq!(validate(&bad).unwrap_err().field, "write");
    }
}
