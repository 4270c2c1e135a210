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
    /// Password.
    pub password: String,
    /// Only accept this user from loopback addresses (RabbitMQ's rule for `guest`).
    #[serde(default)]
    pub loopback_only: bool,
    /// Vhosts the user may open; empty means all configured vhosts.
    #[serde(default)]
    pub vhosts: Vec<String>,
    /// Management tags: `administrator` (full admin API) or `monitoring` (read-only).
    #[serde(default)]
    pub tags: Vec<String>,
}

/// Everything the broker reads at start-up.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// AMQP listener address.
    pub amqp_listen: SocketAddr,
    /// Admin HTTP listener address (metrics, health, JSON API).
    pub admin_listen: SocketAddr,
    /// This node's id, shown in the admin API and used as the queues' `owner`.
    pub node_id: String,
    /// The cluster's name, shown in `/api/overview`.
    pub cluster_name: String,
    /// Failure zone of this node (free text, e.g. a rack or availability zone).
    pub zone: String,
    /// Also put the per-queue gauges of `/metrics/detailed` on `/metrics`.
    pub metrics_per_queue: bool,
    /// At most this many queues get per-queue series (bounds label cardinality).
    pub metrics_max_queues: usize,
    /// Directory holding the broker's state.
    pub data_dir: PathBuf,
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
    /// Seconds a new connection has to finish the handshake.
    pub handshake_timeout_s: u64,
    /// Process memory (RSS) above which publishers are blocked with connection.blocked.
    pub memory_high_watermark_bytes: u64,
    /// Free space on the data dir's file system below which publishers are blocked.
    pub disk_free_limit_bytes: u64,
    /// Bytes of message bodies one queue keeps in memory (flow-to-disk): bodies beyond it
    /// live only in the journal and are read back on delivery. 0 keeps every body in memory.
    pub queue_memory_budget_bytes: u64,
    /// Journal tuning.
    pub journal: crate::store::journal::JournalConfig,
    /// Virtual hosts that exist at start.
    pub vhosts: Vec<String>,
    /// Users. Default: `guest`/`guest`, loopback only.
    pub users: Vec<UserConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            amqp_listen: SocketAddr::from(([127, 0, 0, 1], 5672)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 15672)),
            node_id: default_node_id(),
            cluster_name: "ringmq".to_owned(),
            zone: String::new(),
            metrics_per_queue: false,
            metrics_max_queues: 10_000,
            data_dir: PathBuf::from("data"),
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat_s: 60,
            max_message_size: 128 * 1024 * 1024,
            handshake_timeout_s: 10,
            max_table_depth: 32,
            max_connections: 0,
            max_connections_per_user: 0,
            max_queues_per_vhost: 0,
            max_consumers_per_channel: 0,
            memory_high_watermark_bytes: default_memory_watermark(),
            disk_free_limit_bytes: 50 * 1024 * 1024,
            queue_memory_budget_bytes: 64 * 1024 * 1024,
            journal: crate::store::journal::JournalConfig::default(),
            vhosts: vec!["/".to_owned()],
            users: vec![UserConfig {
                name: "guest".to_owned(),
                password: "guest".to_owned(),
                loopback_only: true,
                vhosts: Vec::new(),
                tags: vec!["administrator".to_owned()],
            }],
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
            queue_memory_budget_bytes: (self.queue_memory_budget_bytes > 0)
                .then_some(usize::try_from(self.queue_memory_budget_bytes).unwrap_or(usize::MAX)),
        }
    }

    /// Checks ranges that the types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.frame_max < crate::amqp::frame::FRAME_MIN_SIZE {
            return Err(ConfigError::Invalid(format!(
                "frame_max {} is below the protocol minimum of 4096 bytes",
                self.frame_max
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn unknown_keys_are_refused() {
        assert!(Config::from_yaml("amqp_lisen: 127.0.0.1:6000\n").is_err());
    }
}
