//! The cluster under test: `ringmq-broker` processes, each in its own network namespace
//! behind the suite's bridge ([`Net`]), supervised as Kubernetes would: a member that exits —
//! killed, or evicted after a pause or a partition (exit status 3) — is started again on its
//! data directory, unless the schedule holds it down.

use ringmq::admin_client::AdminClient;
use ringmq_tests::netns::Net;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The broker's credentials in the suite.
pub const USER: &str = "faults";

/// One member: its process (none while down), where it listens, and whether the supervisor
/// should keep it running.
pub struct Member {
    pub index: usize,
    pub node_id: String,
    pub ip: String,
    child: Mutex<Option<Child>>,
    keep_up: AtomicBool,
    data: PathBuf,
    netns: String,
}

impl Member {
    pub fn amqp_uri(&self) -> String {
        format!("amqp://{USER}:{USER}@{}:5672/%2f", self.ip)
    }

    pub fn cluster_addr(&self) -> String {
        format!("{}:25672", self.ip)
    }

    pub fn admin(&self) -> AdminClient {
        AdminClient::new(&format!("http://{}:15672", self.ip), Some(USER), Some(USER))
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|c| i32::try_from(c.id()).ok())
    }

    fn signal(&self, signal: libc::c_int) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on a process this suite started and has not reaped.
            unsafe { libc::kill(pid, signal) };
        }
    }

    /// kill -9; the supervisor starts it again unless held down.
    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
    }

    /// SIGTERM: a graceful stop (a drained member leaves the voters on its way out); the
    /// supervisor starts it again unless held down.
    pub fn terminate(&self) {
        self.signal(libc::SIGTERM);
    }

    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Whether it answers `/readyz` 200 (holds the majority's lease and the newest map).
    pub fn ready(&self) -> bool {
        self.admin().get("/readyz").is_ok_and(|a| a.status == 200)
    }
}

/// The supervised cluster.
pub struct Cluster {
    pub net: Net,
    pub members: Vec<Arc<Member>>,
    secret: PathBuf,
    broker: PathBuf,
    stop: Arc<AtomicBool>,
    restarts: Arc<std::sync::atomic::AtomicU64>,
}

impl Cluster {
    /// Creates the namespaces and starts `n` members one after the other (each joining
    /// through the ones before), then the supervisor.
    pub fn start(n: usize, subnet: u8, broker: PathBuf) -> Result<Arc<Cluster>, String> {
        let net = Net::create("flt", subnet, n);
        // The suite's own thread (and every thread it starts from here on: clients,
        // supervisor, sampler) lives in the hub namespace, where the bridge reaches every
        // member.
        net.enter_hub();
        let pid = std::process::id();
        let secret = std::env::temp_dir().join(format!("ringmq-faults-{pid}.secret"));
        std::fs::write(&secret, "faults-cluster-secret\n").expect("temp dir is writable");
        let members = (0..n)
            .map(|i| {
                Arc::new(Member {
                    index: i,
                    node_id: format!("m{i}"),
                    ip: net.addr(i),
                    child: Mutex::new(None),
                    keep_up: AtomicBool::new(true),
                    data: std::env::temp_dir().join(format!("ringmq-faults-{pid}-m{i}")),
                    netns: net.members[i].clone(),
                })
            })
            .collect();
        let cluster = Arc::new(Cluster {
            net,
            members,
            secret,
            broker,
            stop: Arc::new(AtomicBool::new(false)),
            restarts: Arc::default(),
        });
        for m in &cluster.members {
            let seeds: Vec<String> = cluster.members[..m.index]
                .iter()
                .map(|m| m.cluster_addr())
                .collect();
            cluster.spawn(m, &seeds);
            if let Err(e) = cluster.wait_ready(m, Duration::from_secs(60)) {
                cluster.shutdown();
                return Err(e);
            }
        }
        let supervised = Arc::clone(&cluster);
        std::thread::spawn(move || supervised.supervise());
        Ok(cluster)
    }

    fn spawn(&self, m: &Member, seeds: &[String]) {
        let ip = &m.ip;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &m.netns])
            .arg(&self.broker)
            .args(["--amqp-listen", &format!("{ip}:5672")])
            .args(["--admin-listen", &format!("{ip}:15672")])
            .args(["--cluster-listen", &m.cluster_addr()])
            .arg("--cluster-secret-file")
            .arg(&self.secret)
            .arg("--data-dir")
            .arg(&m.data)
            .args(["--node-id", &m.node_id])
            .env(
                "RINGMQ_LOG",
                std::env::var("FAULTS_BROKER_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("RINGMQ_DEFAULT_USER", USER)
            .env("RINGMQ_DEFAULT_PASS", USER)
            .env("RINGMQ_PASSWORD_HASH_ITERATIONS", "10000")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file(&m.data)));
        if !seeds.is_empty() {
            cmd.args(["--cluster-seeds", &seeds.join(",")]);
        }
        let child = cmd.spawn().expect("ringmq-broker starts");
        *m.child.lock().unwrap() = Some(child);
    }

    /// Waits for member `m` to serve, for at most `limit`.
    pub fn wait_ready(&self, m: &Member, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        while !m.ready() {
            if Instant::now() > deadline {
                return Err(format!(
                    "member {} not ready within {limit:?}; its log:\n{}",
                    m.node_id,
                    tail(&m.data, 30)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Waits until every member serves (`false` after `limit`).
    pub fn all_ready(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.members.iter().all(|m| m.ready()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    }

    /// Holds member `m` down (the supervisor leaves it stopped) or lets it up again.
    pub fn hold_down(&self, m: &Member, down: bool) {
        m.keep_up.store(!down, Ordering::SeqCst);
    }

    /// How many times the supervisor started a member again.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// Restarts members that exited, every 100 ms, until the cluster is dropped: a member
    /// restarted joins through all the others.
    fn supervise(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            for m in &self.members {
                let exited = {
                    let mut child = m.child.lock().unwrap();
                    match child.as_mut().map(Child::try_wait) {
                        Some(Ok(Some(status))) => {
                            *child = None;
                            Some(status)
                        }
                        _ => None,
                    }
                };
                if let Some(status) = exited {
                    eprintln!("faults: member {} exited ({status})", m.node_id);
                }
                let down = m.child.lock().unwrap().is_none();
                if down && m.keep_up.load(Ordering::SeqCst) && !self.stop.load(Ordering::SeqCst) {
                    let seeds: Vec<String> = self
                        .members
                        .iter()
                        .filter(|o| o.index != m.index)
                        .map(|o| o.cluster_addr())
                        .collect();
                    self.spawn(m, &seeds);
                    self.restarts.fetch_add(1, Ordering::Relaxed);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Each member's claim on `queue`, read in one admin answer taken at one instant of that
    /// member (`GET /api/queues/%2f/{queue}`, whose `cluster` stamp the broker reads under
    /// a seqlock): the members that name themselves its primary while holding the
    /// majority's lease, with the configuration (agreed index of the ring change) their
    /// roles belong to.
    pub fn primary_claims(&self, queue: &str) -> Vec<Claim> {
        self.members
            .iter()
            .filter_map(|m| {
                let q = m.admin().get(&format!("/api/queues/%2f/{queue}")).ok()?;
                let stamp = &q.body["cluster"];
                let claims = q.status == 200
                    && q.body["node"].as_str() == Some(m.node_id.as_str())
                    && stamp["quorum"].as_bool() == Some(true);
                let configuration = stamp["configuration"].as_u64()?;
                claims.then(|| Claim {
                    member: m.node_id.clone(),
                    configuration,
                })
            })
            .collect()
    }
}

/// A member that named itself a queue's primary while it held the majority's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Its node id.
    pub member: String,
    /// The configuration its roles belonged to.
    pub configuration: u64,
}

impl Cluster {
    /// Stops the supervisor and every member (by the PIDs it started), and removes their
    /// data and the secret; the namespaces go when the [`Net`] is dropped. Called by the
    /// suite before it exits — the supervisor and sampler threads hold the cluster too, so
    /// `Drop` alone would never run — and again, harmlessly, by `Drop`.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(200));
        for m in &self.members {
            m.resume();
            if let Some(mut child) = m.child.lock().unwrap().take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = std::fs::remove_dir_all(&m.data);
            eprintln!(
                "faults: {}'s log: {}",
                m.node_id,
                log_path(&m.data).display()
            );
        }
        let _ = std::fs::remove_file(&self.secret);
        self.net.remove();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn log_path(data: &Path) -> PathBuf {
    data.with_extension("log")
}

fn log_file(data: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(data))
        .expect("temp dir is writable")
}

/// The last `n` lines of a member's log.
pub fn tail(data: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log_path(data)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Member {
    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&self.data, n)
    }
}
