//! Broker configuration: one YAML file, overridden by command-line flags and `RINGMQ_*`
//! environment variables. Every field has a default that runs a single broker on loopback.

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A user of the broker.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Login name.
    pub name: String,
    /// Password in plaintext; hashed with PBKDF2 when the file is loaded. Give this or
    /// `password_hash`.
    #[serde(default)]
    pub password: Option<String>,
    /// A stored hash instead of a password: `$pbkdf2-sha256$...` (`ringmqctl hash-password`
    /// prints one) or RabbitMQ's `rabbit_password_hashing_sha256` base64. Empty: no password
    /// logs in (EXTERNAL only).
    #[serde(default)]
    pub password_hash: Option<String>,
    /// Only accept this user from loopback addresses (RabbitMQ's rule for `guest`).
    #[serde(default)]
    pub loopback_only: bool,
    /// Vhosts the user may open, with full permissions; empty means all configured vhosts
    /// (unless `permissions` is given).
    #[serde(default)]
    pub vhosts: Vec<String>,
    /// Per-vhost permissions (RabbitMQ's configure/write/read expressions), e.g.
    /// `{"/": {configure: "^app-", write: ".*", read: ".*"}}`. When given, the user may open
    /// exactly these vhosts; give this or `vhosts`, not both.
    #[serde(default)]
    pub permissions: std::collections::BTreeMap<String, crate::auth::Permission>,
    /// Management tags: `administrator` (full admin API) or `monitoring` (read-only).
    #[serde(default)]
    pub tags: Vec<String>,
}

impl UserConfig {
    /// The (vhost, permission) pairs this user gets: its `permissions`, else full access to
    /// its `vhosts`, else full access to every vhost in `all_vhosts`.
    pub fn vhost_permissions(
        &self,
        all_vhosts: &[String],
    ) -> Vec<(String, crate::auth::Permission)> {
        if !self.permissions.is_empty() {
            return self
                .permissions
                .iter()
                .map(|(v, p)| (v.clone(), p.clone()))
                .collect();
        }
        let vhosts = if self.vhosts.is_empty() {
            all_vhosts
        } else {
            &self.vhosts
        };
        vhosts
            .iter()
            .map(|v| (v.clone(), crate::auth::Permission::full()))
            .collect()
    }

    /// The user's stored password: the given hash, or the plaintext password hashed with
    /// PBKDF2 at `iterations`.
    pub fn stored_password(
        &self,
        iterations: u32,
    ) -> Result<crate::auth::PasswordHash, ConfigError> {
        use crate::auth::PasswordHash;
        match (&self.password, &self.password_hash) {
            (Some(p), None) => Ok(PasswordHash::new(p, iterations)),
            (None, Some(h)) => PasswordHash::parse(h, None)
                .map_err(|e| ConfigError::Invalid(format!("user '{}': {e}", self.name))),
            _ => Err(ConfigError::Invalid(format!(
                "user '{}' needs exactly one of password or password_hash",
                self.name
            ))),
        }
    }
}

/// Everything the broker reads at start-up.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// AMQP listener address.
    pub amqp_listen: SocketAddr,
    /// Whether the plaintext AMQP listener runs; `false` with `amqps_listen` set makes the
    /// broker TLS-only (`--no-plaintext`).
    pub amqp_listen_enabled: bool,
    /// TLS (amqps) listener address; none means no TLS listener. Needs `tls_cert_file` and
    /// `tls_key_file`.
    pub amqps_listen: Option<SocketAddr>,
    /// PEM certificate chain the TLS listener presents (leaf first).
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA certificates that client certificates must chain to; with it the broker asks
    /// clients for a certificate and offers SASL EXTERNAL to those that present one.
    pub tls_ca_file: Option<PathBuf>,
    /// Verify client certificates against `tls_ca_file` (RabbitMQ's `verify_peer`); only
    /// meaningful with a CA file.
    pub tls_verify_peer: bool,
    /// Refuse TLS clients that present no certificate (RabbitMQ's `fail_if_no_peer_cert`).
    pub tls_fail_if_no_peer_cert: bool,
    /// How often the certificate, key and CA files are checked for changes, in seconds; a
    /// change is loaded for new connections without a restart.
    pub tls_reload_interval_s: u64,
    /// Admin HTTP listener address (metrics, health, JSON API).
    pub admin_listen: SocketAddr,
    /// This node's id, shown in the admin API and used as the queues' `owner`.
    pub node_id: String,
    /// The cluster's name, shown in `/api/overview`.
    pub cluster_name: String,
    /// Failure zone of this node (free text, e.g. a rack or availability zone).
    pub zone: String,
    /// A file this node's zone is read from at start, over `zone`: either the zone alone,
    /// or a Kubernetes downward API `labels` file (lines `key="value"`), whose
    /// [`ZONE_LABEL`] is taken — the operator copies each broker pod's node zone onto the
    /// pod under it, and the kubelet refreshes the file.
    pub zone_file: Option<PathBuf>,
    /// How long the broker waits at start for `zone_file` to name a zone, in seconds,
    /// before it starts without one (logged).
    pub zone_file_wait_s: u64,
    /// Where this member goes on the cluster's ring when it first joins: among the members
    /// with a `ring_order`, after those with a lower or equal one (a StatefulSet's pod
    /// ordinal, say). Unset, the planner picks the gap that keeps zones apart and ships the
    /// fewest backups. A member keeps its place when it restarts.
    pub ring_order: Option<u32>,
    /// Also put the per-queue gauges of `/metrics/detailed` on `/metrics`.
    pub metrics_per_queue: bool,
    /// At most this many queues get per-queue series (bounds label cardinality).
    pub metrics_max_queues: usize,
    /// Directory holding the broker's state.
    pub data_dir: PathBuf,
    /// Threads that run the connections, links and cluster tasks; unset, one per core the
    /// broker may use (its cgroup's CPU limit counts). Members that share a machine (a
    /// local cluster) do better splitting its cores than each taking them all: fewer
    /// threads to wake and switch between per message.
    pub worker_threads: Option<usize>,
    /// Largest frame the broker accepts and offers in connection.tune, in bytes.
    pub frame_max: u32,
    /// Most channels per connection offered in connection.tune.
    pub channel_max: u16,
    /// Heartbeat interval offered in connection.tune, in seconds (0 disables).
    pub heartbeat_s: u16,
    /// Largest message body accepted, in bytes (RabbitMQ's default: 128 MiB).
    pub max_message_size: u64,
    /// Deepest nesting of field tables and arrays accepted in method arguments and message
    /// headers (deeper input is a 502 syntax error: the decoder is recursive).
    pub max_table_depth: usize,
    /// Most open connections (0 = no limit); beyond it connection.open gets 530.
    pub max_connections: usize,
    /// Most open connections per user (0 = no limit); beyond it connection.open gets 530.
    pub max_connections_per_user: usize,
    /// Most queues per vhost (0 = no limit); beyond it queue.declare gets 406.
    pub max_queues_per_vhost: usize,
    /// Most consumers per channel (0 = no limit); beyond it basic.consume gets 406.
    pub max_consumers_per_channel: usize,
    /// Most unacked deliveries per channel (0 = no limit), whatever the client's prefetch:
    /// consumers get no more until it acks; a basic.get beyond it gets 406.
    pub max_unacked_per_channel: u32,
    /// Seconds a new connection has to finish the handshake.
    pub handshake_timeout_s: u64,
    /// Seconds a client may take no byte the broker writes before its connection is closed
    /// (it stopped reading; RabbitMQ's TCP `send_timeout`). Until then it gets no more
    /// deliveries than its channels' write windows and the rest stay in their queues.
    pub write_stall_timeout_s: u64,
    /// Process memory (RSS) above which publishers are blocked with connection.blocked.
    pub memory_high_watermark_bytes: u64,
    /// Free space on the data dir's file system below which publishers are blocked.
    pub disk_free_limit_bytes: u64,
    /// Cluster port (`--cluster-listen`); `None` runs a standalone broker.
    pub cluster_listen: Option<SocketAddr>,
    /// Members to ask for admission (`--cluster-seeds`, `host:port` or DNS names that
    /// resolve to the peers); empty founds a new cluster.
    pub cluster_seeds: Vec<String>,
    /// File holding the shared cluster secret (`--cluster-secret-file`); every member must
    /// use the same. Required with `cluster_listen`.
    pub cluster_secret_file: Option<PathBuf>,
    /// Host name or address other members and clients use to reach this broker, when the
    /// listeners bind a wildcard address (a pod's DNS name in Kubernetes).
    pub advertise_host: Option<String>,
    /// How long a silent member stays in the cluster before the others remove it: about the
    /// failover time of a replicated queue. Must exceed 2 × the quorum lease (300 ms) + the
    /// heartbeat (50 ms), so that a member's lease has run out when it is removed
    /// (`docs/cpg.md`).
    pub cluster_failure_timeout_ms: u64,
    /// Node id of the member that founds the cluster when no seed admits it within
    /// `cluster_join_timeout_ms` (the operator names pod 0). Every other member only joins.
    pub cluster_founder: Option<String>,
    /// How long a starting member tries to be admitted and receive the cluster map before
    /// it gives up and exits.
    pub cluster_join_timeout_ms: u64,
    /// Where a queue declared without `qpid.cluster.primary` gets its primary:
    /// `client-local` (the member the declare arrived at, the default) or `balanced` (the
    /// member with the fewest primaries), RabbitMQ's `queue_leader_locator` values. A declare
    /// argument `x-queue-leader-locator` overrides it for one queue.
    pub queue_primary_locator: crate::cluster::placement::PrimaryLocator,
    /// How many backups (0..=3) a clustered queue declared without `qpid.cluster.backups`
    /// keeps: its primary's next members in the ring, each a full copy that can take over.
    /// 0: proxied from every member but lost with its primary. Exclusive queues have none.
    pub default_backups: u8,
    /// The longest a resumable session outlives a lost connection, in seconds: a client's
    /// `qpid.session.timeout` is cut to it, and `connection.start` advertises it
    /// (`docs/sessions.md`).
    pub session_max_timeout_s: u64,
    /// The timeout a session gets when its client asks for none, in seconds.
    pub session_default_timeout_s: u64,
    /// Bytes of message bodies one queue keeps in memory (flow-to-disk): bodies beyond it
    /// live only in the journal and are read back on delivery. 0 keeps every body in memory.
    pub queue_memory_budget_bytes: u64,
    /// How long a backup's catch-up of one queue (its image in chunks, then the ops held
    /// back meanwhile, confirmed by the backup) may take before it is abandoned and retried
    /// from a new image, in ms.
    pub replication_catch_up_timeout_ms: u64,
    /// Bytes of a queue's ops a catch-up holds back while the image's chunks are still
    /// going out; a queue that changes faster than that abandons the catch-up, which is
    /// retried from a new image.
    pub replication_catch_up_held_bytes: u64,
    /// Journal tuning.
    pub journal: crate::store::journal::JournalConfig,
    /// Virtual hosts that exist at start.
    pub vhosts: Vec<String>,
    /// Users. Default: `guest`/`guest`, loopback only.
    pub users: Vec<UserConfig>,
    /// Failed logins allowed per source address within `login_failures_window_s` (0 = no
    /// limit); beyond it logins from that address are refused unchecked until the window ends.
    pub login_failures_max: u32,
    /// The window of `login_failures_max`, in seconds.
    pub login_failures_window_s: u64,
    /// PBKDF2 iterations for passwords hashed by this broker (config users, admin API,
    /// `ringmqctl hash-password` has its own flag). Stored hashes keep the count they were
    /// made with.
    pub password_hash_iterations: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp_listen: SocketAddr::from(([127, 0, 0, 1], 5672)),
            amqp_listen_enabled: true,
            amqps_listen: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            tls_verify_peer: true,
            tls_fail_if_no_peer_cert: false,
            tls_reload_interval_s: 5,
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 15672)),
            node_id: default_node_id(),
            cluster_name: "ringmq".to_owned(),
            zone: String::new(),
            ring_order: None,
            zone_file: None,
            zone_file_wait_s: 120,
            metrics_per_queue: false,
            metrics_max_queues: 10_000,
            data_dir: PathBuf::from("data"),
            worker_threads: None,
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat_s: 60,
            max_message_size: 128 * 1024 * 1024,
            handshake_timeout_s: 10,
            write_stall_timeout_s: 30,
            max_table_depth: 32,
            max_connections: 0,
            max_connections_per_user: 0,
            max_queues_per_vhost: 0,
            max_consumers_per_channel: 0,
            max_unacked_per_channel: 0,
            memory_high_watermark_bytes: default_memory_watermark(),
            disk_free_limit_bytes: 50 * 1024 * 1024,
            cluster_listen: None,
            cluster_seeds: Vec::new(),
            cluster_secret_file: None,
            advertise_host: None,
            cluster_failure_timeout_ms: 700,
            cluster_join_timeout_ms: 30_000,
            cluster_founder: None,
            queue_primary_locator: Default::default(),
            default_backups: crate::cluster::roles::DEFAULT_BACKUPS,
            session_max_timeout_s: 300,
            session_default_timeout_s: 60,
            queue_memory_budget_bytes: 64 * 1024 * 1024,
            replication_catch_up_timeout_ms: 120_000,
            replication_catch_up_held_bytes: 64 * 1024 * 1024,
            journal: crate::store::journal::JournalConfig::default(),
            vhosts: vec!["/".to_owned()],
            users: vec![UserConfig {
                name: "guest".to_owned(),
                password: Some("guest".to_owned()),
                password_hash: None,
                loopback_only: true,
                vhosts: Vec::new(),
                permissions: Default::default(),
                tags: vec!["administrator".to_owned()],
            }],
            password_hash_iterations: crate::auth::password::DEFAULT_ITERATIONS,
            login_failures_max: 5,
            login_failures_window_s: 10,
        }
    }
}

/// `ringmq@HOSTNAME`, RabbitMQ's node naming.
fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("ringmq@{host}")
}

/// 40% of physical memory, RabbitMQ's default relative watermark; 1 GiB when unknown.
fn default_memory_watermark() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
    });
    total.map(|kb| kb * 1024 * 2 / 5).unwrap_or(1 << 30)
}

/// Why a configuration could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid YAML for this schema.
    #[error("config file {path} is invalid: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads a YAML config file; fields it leaves out keep their defaults.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_yaml(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_saphyr::from_str(text).map_err(|e| e.to_string())
    }

    /// The limits every vhost enforces.
    pub fn vhost_limits(&self) -> crate::core::vhost::Limits {
        crate::core::vhost::Limits {
            max_queues: self.max_queues_per_vhost,
            max_consumers_per_channel: self.max_consumers_per_channel,
            max_unacked_per_channel: self.max_unacked_per_channel,
            queue_memory_budget_bytes: (self.queue_memory_budget_bytes > 0)
                .then_some(usize::try_from(self.queue_memory_budget_bytes).unwrap_or(usize::MAX)),
        }
    }

    /// The bounds of a backup's catch-up: chunks of at most 1 MiB (less when
    /// `max_message_size` is smaller: a chunk is one message on the link, and every member
    /// should share the limit), the time limit and the ops held back.
    pub fn catch_up_limits(&self) -> crate::replication::catch_up::CatchUpLimits {
        crate::replication::catch_up::CatchUpLimits {
            chunk: crate::replication::codec::ChunkLimits::for_max_message_size(
                self.max_message_size,
            ),
            held_bytes: usize::try_from(self.replication_catch_up_held_bytes).unwrap_or(usize::MAX),
            timeout: std::time::Duration::from_millis(self.replication_catch_up_timeout_ms),
            ..Default::default()
        }
    }

    /// Checks ranges that the types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.worker_threads == Some(0) {
            return Err(ConfigError::Invalid(
                "worker_threads must be at least 1 (leave it unset for one per core)".into(),
            ));
        }
        if self.frame_max < crate::amqp::frame::FRAME_MIN_SIZE {
            return Err(ConfigError::Invalid(format!(
                "frame_max {} is below the protocol minimum of 4096 bytes",
                self.frame_max
            )));
        }
        if self.replication_catch_up_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "replication_catch_up_timeout_ms must be above 0 (a catch-up needs time to send its image)".into(),
            ));
        }
        if self.cluster_listen.is_some() && self.cluster_secret_file.is_none() {
            return Err(ConfigError::Invalid(
                "a cluster member needs the shared secret: set --cluster-secret-file (or cluster_secret_file)".into(),
            ));
        }
        if self.cluster_listen.is_none() && !self.cluster_seeds.is_empty() {
            return Err(ConfigError::Invalid(
                "--cluster-seeds needs --cluster-listen (the port other members reach this one on)"
                    .into(),
            ));
        }
        if self.amqps_listen.is_some()
            && (self.tls_cert_file.is_none() || self.tls_key_file.is_none())
        {
            return Err(ConfigError::Invalid(
                "amqps_listen needs tls_cert_file and tls_key_file (--tls-cert, --tls-key)".into(),
            ));
        }
        if !self.amqp_listen_enabled && self.amqps_listen.is_none() {
            return Err(ConfigError::Invalid(
                "the plaintext listener is disabled and no amqps_listen is set: \
                 clients could not connect at all"
                    .into(),
            ));
        }
        if self.tls_fail_if_no_peer_cert && self.tls_ca_file.is_none() {
            return Err(ConfigError::Invalid(
                "tls_fail_if_no_peer_cert needs tls_ca_file (--tls-ca) to verify certificates"
                    .into(),
            ));
        }
        use crate::auth::password::{MAX_ITERATIONS, MIN_ITERATIONS};
        if !(MIN_ITERATIONS..=MAX_ITERATIONS).contains(&self.password_hash_iterations) {
            return Err(ConfigError::Invalid(format!(
                "password_hash_iterations {} is outside {MIN_ITERATIONS}..={MAX_ITERATIONS}",
                self.password_hash_iterations
            )));
        }
        for u in &self.users {
            // The cheapest cost: this only checks that a password or a valid hash is there.
            u.stored_password(MIN_ITERATIONS)?;
            if !u.permissions.is_empty() && !u.vhosts.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "user '{}' has both vhosts and permissions: give one",
                    u.name
                )));
            }
            for (vhost, p) in &u.permissions {
                crate::auth::permissions::validate(p).map_err(|e| {
                    ConfigError::Invalid(format!("user '{}', vhost '{vhost}': {e}", u.name))
                })?;
            }
        }
        if self.write_stall_timeout_s == 0 {
            return Err(ConfigError::Invalid(
                "write_stall_timeout_s must be at least 1".into(),
            ));
        }
        if self.tls_reload_interval_s == 0 {
            return Err(ConfigError::Invalid(
                "tls_reload_interval_s must be at least 1".into(),
            ));
        }
        if self.default_backups > crate::cluster::roles::MAX_BACKUPS {
            return Err(ConfigError::Invalid(format!(
                "default_backups {} is outside 0..={}: a queue keeps at most {} backups",
                self.default_backups,
                crate::cluster::roles::MAX_BACKUPS,
                crate::cluster::roles::MAX_BACKUPS
            )));
        }
        if self.session_default_timeout_s == 0
            || self.session_default_timeout_s > self.session_max_timeout_s
        {
            return Err(ConfigError::Invalid(format!(
                "session_default_timeout_s {} must be between 1 and session_max_timeout_s ({})",
                self.session_default_timeout_s, self.session_max_timeout_s
            )));
        }
        if self.vhosts.is_empty() {
            return Err(ConfigError::Invalid(
                "at least one vhost is needed (e.g. vhosts: [\"/\"])".into(),
            ));
        }
        Ok(())
    }
}

/// The label a Kubernetes node's zone is under, which the operator copies onto each broker
/// pod (its downward API `labels` file is then a `zone_file`).
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The zone `text` names: a downward API labels file's [`ZONE_LABEL`] (`key="value"`
/// lines; a label value holds no quote or backslash to unescape) — empty when the label is
/// there but empty, which the operator writes for a node that has no zone: no zone, and no
/// more waiting — or, for a file without `=`, its one trimmed line. `None` when it names
/// none (yet).
pub fn zone_in(text: &str) -> Option<String> {
    if !text.contains('=') {
        let zone = text.trim();
        return (!zone.is_empty() && !zone.contains('\n')).then(|| zone.to_owned());
    }
    text.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        if key.trim() != ZONE_LABEL {
            return None;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(value);
        Some(value.to_owned())
    })
}

impl Config {
    /// Reads the zone from `zone_file`, if one is set, waiting up to `zone_file_wait_s` for
    /// it to name one (checked every half second); without one by then the broker starts
    /// with `zone` as configured, and says so.
    pub fn read_zone_file(&mut self) {
        let Some(path) = self.zone_file.clone() else {
            return;
        };
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_secs(self.zone_file_wait_s);
        loop {
            if let Some(zone) = std::fs::read_to_string(&path)
                .ok()
                .as_deref()
                .and_then(zone_in)
            {
                tracing::info!(zone, file = %path.display(), "zone read from the zone file");
                self.zone = zone;
                return;
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(
                    file = %path.display(),
                    waited_s = self.zone_file_wait_s,
                    zone = self.zone,
                    "the zone file names no zone (on Kubernetes: is the operator labelling the \
                     pods with their node's {ZONE_LABEL}?); starting with the configured zone"
                );
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zone_comes_from_a_labels_file_or_a_plain_one() {
        let labels =
            "app.kubernetes.io/name=\"ringmq\"\ntopology.kubernetes.io/zone=\"eu-west-1a\"\n";
        assert_eq!(zone_in(labels).as_deref(), Some("eu-west-1a"));
        assert_eq!(
            zone_in("app.kubernetes.io/name=\"ringmq\"\n"),
            None,
            "not labelled yet"
        );
        assert_eq!(
            zone_in("topology.kubernetes.io/zone=\"\"\n").as_deref(),
            Some(""),
            "labelled: the node has no zone"
        );
        assert_eq!(zone_in("rack-7\n").as_deref(), Some("rack-7"));
        assert_eq!(zone_in("  \n"), None);
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        assert_eq!(Config::from_yaml("").unwrap(), Config::default());
    }

    #[test]
    fn a_file_overrides_only_what_it_names() {
        let c = Config::from_yaml(
            "amqp_listen: 127.0.0.1:6000\nusers:\n  - name: app\n    password: s3cret\n",
        )
        .unwrap();
        assert_eq!(c.amqp_listen.port(), 6000);
        assert_eq!(c.users.len(), 1);
        assert_eq!(c.users[0].name, "app");
        assert_eq!(c.frame_max, Config::default().frame_max);
    }

    #[test]
    fn default_backups_is_one_and_more_than_three_is_refused() {
        assert_eq!(Config::default().default_backups, 1);
        let c = Config::from_yaml("default_backups: 3\n").unwrap();
        assert!(c.validate().is_ok());
        let c = Config::from_yaml("default_backups: 4\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("default_backups 4 is outside 0..=3"), "{err}");
    }

    #[test]
    fn worker_threads_is_one_per_core_unless_set_and_zero_is_refused() {
        assert_eq!(Config::default().worker_threads, None);
        let c = Config::from_yaml("worker_threads: 1\n").unwrap();
        assert_eq!(c.worker_threads, Some(1));
        assert!(c.validate().is_ok());
        let err = Config::from_yaml("worker_threads: 0\n")
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("worker_threads must be at least 1"), "{err}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        assert!(Config::from_yaml("amqp_lisen: 127.0.0.1:6000\n").is_err());
    }
}
