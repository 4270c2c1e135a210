//! A private RabbitMQ node (Debian's `rabbitmq-server`) on loopback for tests that check
//! interoperability against the real thing: its own node name, ports and directories, started
//! on demand and stopped (by `rabbitmqctl stop`, then its PID) when dropped. `scripts/test`
//! installs the package when it runs as root; without it the test fails saying so.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running RabbitMQ node.
pub struct RabbitMq {
    /// AMQP port on 127.0.0.1 (user guest/guest, vhost `/`).
    pub port: u16,
    node: String,
    dir: PathBuf,
    /// The node's environment (ports, directories), the same for every command on it.
    env: Vec<(String, String)>,
    child: Child,
}

impl RabbitMq {
    /// Starts a node and waits (two minutes at most) until it accepts AMQP connections.
    pub fn start() -> Self {
        let installed = |cmd: &str| {
            std::env::var_os("PATH")
                .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(cmd).is_file()))
        };
        assert!(
            installed("rabbitmq-server") && installed("rabbitmqctl"),
            "this test needs a real RabbitMQ: install Debian's rabbitmq-server (`scripts/test` \
             does when it runs as root: apt-get install rabbitmq-server)"
        );
        let port = crate::free_port();
        let node = format!("ringmqtest{}x{port}@localhost", std::process::id());
        let dir =
            std::env::temp_dir().join(format!("ringmq-rabbitmq-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("mnesia")).expect("temp dir is writable");
        std::fs::create_dir_all(dir.join("log")).expect("temp dir is writable");
        // Debian's wrapper runs the node as the rabbitmq user when started as root.
        let _ = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status();
        let env = Self::env(&node, port, &dir);
        let child = Command::new("rabbitmq-server")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("rabbitmq-server starts");
        let rabbit = Self {
            port,
            node,
            dir,
            env: env.clone(),
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = Command::new("rabbitmqctl")
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .args(["-n", &rabbit.node, "await_startup", "--timeout", "5"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return rabbit;
            }
            if Instant::now() > deadline {
                let log = std::fs::read_dir(rabbit.dir.join("log"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|f| std::fs::read_to_string(f.path()).ok())
                    .collect::<Vec<_>>()
                    .join("\n");
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                panic!(
                    "RabbitMQ did not start within 2 minutes; its log ends:\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/VHOST` with `vhost` percent-encoded (`/` as `%2f`).
    pub fn uri_for(&self, vhost: &str) -> String {
        let encoded: String = vhost
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02x}"),
            })
            .collect();
        format!("amqp://guest:guest@127.0.0.1:{}/{encoded}", self.port)
    }

    /// Creates `vhost` on the node and gives guest every permission in it.
    pub fn add_vhost(&self, vhost: &str) {
        self.ctl(&["add_vhost", vhost]);
        self.ctl(&["set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"]);
    }

    /// The queues of `vhost` on the node, each with its messages, ready and unacked.
    pub fn queues(&self, vhost: &str) -> Vec<(String, u64)> {
        self.ctl(&[
            "list_queues",
            "-p",
            vhost,
            "--silent",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .lines()
        .filter_map(|l| {
            let (name, messages) = l.trim().rsplit_once(char::is_whitespace)?;
            Some((name.trim().to_owned(), messages.parse().ok()?))
        })
        .collect()
    }

    /// Runs `rabbitmqctl` on the node and returns its output; panics when it fails.
    fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new("rabbitmqctl")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .args(["-n", &self.node])
            .args(args)
            .output()
            .expect("rabbitmqctl runs");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The environment of a node: its name, ports on loopback and directories.
    fn env(node: &str, port: u16, dir: &std::path::Path) -> Vec<(String, String)> {
        let d = |p: &str| dir.join(p).display().to_string();
        vec![
            ("RABBITMQ_NODENAME".into(), node.into()),
            ("RABBITMQ_NODE_IP_ADDRESS".into(), "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT".into(), port.to_string()),
            ("RABBITMQ_DIST_PORT".into(), crate::free_port().to_string()),
            ("ERL_EPMD_ADDRESS".into(), "127.0.0.1".into()),
            ("ERL_EPMD_PORT".into(), crate::free_port().to_string()),
            ("RABBITMQ_MNESIA_BASE".into(), d("mnesia")),
            ("RABBITMQ_LOG_BASE".into(), d("log")),
            ("RABBITMQ_PID_FILE".into(), d("rabbitmq.pid")),
            (
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS".into(),
                "-kernel inet_dist_use_interface {127,0,0,1}".into(),
            ),
        ]
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        let env = self.env.clone();
        let _ = Command::new("rabbitmqctl")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .args(["-n", &self.node, "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The node's own epmd (on its private port) goes too.
        let epmd_port = env
            .iter()
            .find(|(k, _)| k == "ERL_EPMD_PORT")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        // It refuses while the stopped node is still registered: a few tries, bounded.
        for _ in 0..20 {
            let killed = Command::new("epmd")
                .args(["-port", &epmd_port, "-kill"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains("Killed"))
                .unwrap_or(true);
            if killed {
                break;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
