//! Test harness: starts the real `ringmq-broker` binary on an OS-assigned loopback port and
//! connects real clients to it. Each test gets its own broker process and data directory, so
//! tests run in parallel and a broker can be killed without touching the others.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

pub use lapin;

pub mod cluster;
pub mod netns;
pub mod prereq;
pub mod rabbitmq;
pub mod tls;

/// Path of a binary built from this workspace (`ringmq-broker`, `ringmqctl`), next to the
/// test executable's `deps/` directory.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binaries live in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins` (the README's test command does)",
        path.display()
    );
    path
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

/// PBKDF2 iterations the test brokers hash passwords with (the environment variable of the
/// same name overrides it).
pub const TEST_HASH_ITERATIONS: u32 = 10_000;

/// A broker process owned by a test; killed (by its PID) when dropped.
pub struct Broker {
    child: Child,
    /// AMQP address it listens on (the TLS one when the plaintext listener is disabled).
    pub addr: SocketAddr,
    /// TLS (amqps) address, when the configuration enables it (`amqps_listen`).
    pub amqps: Option<SocketAddr>,
    /// Admin HTTP address it listens on.
    pub admin: SocketAddr,
    /// Its data directory.
    pub data_dir: PathBuf,
    /// Lines it wrote to stderr (its log), collected in the background.
    pub log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Cluster port address, for a broker whose config sets `cluster_listen`.
    pub cluster: Option<String>,
    /// The fixed ports it was started on ([`Broker::start_on_ports`]), kept across restarts.
    fixed: Option<Ports>,
}

/// How long [`Broker::connect`] keeps asking a cluster member that says it is not ready.
pub const NOT_READY_PATIENCE: Duration = Duration::from_secs(10);

/// Ports a broker listens on, chosen before it starts so that a restarted cluster member
/// comes back at the same addresses (its consensus peers know it by them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// AMQP listener.
    pub amqp: SocketAddr,
    /// Admin HTTP listener.
    pub admin: SocketAddr,
    /// Cluster port.
    pub cluster: SocketAddr,
}

impl Ports {
    /// Three free 127.0.0.1 ports (see [`free_port`]).
    pub fn allocate() -> Self {
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ports {
            amqp: at(free_port()),
            admin: at(free_port()),
            cluster: at(free_port()),
        }
    }
}

/// The ports [`free_port`] picks from: below the kernel's ephemeral range (32768–60999 by
/// default), which outgoing connections take their source ports from. A member that a test
/// kills and starts again on its ports leaves them free meanwhile; in the ephemeral range any
/// of the thousands of connections the other tests open could take one as its source port,
/// and the restarted member could not bind it (seen once in CI: a member exited at start).
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// How long a port [`free_port`] handed out stays reserved for the test that asked: longer
/// than any test runs.
const PORT_RESERVATION: Duration = Duration::from_secs(20 * 60);

/// Reserves `port` for this test process across the tests running beside it (each in its
/// own process under nextest): a file named after the port, created only if absent or older
/// than [`PORT_RESERVATION`]. Without it, two tests picking the same port at the same
/// moment both found it free, and the second broker to bind it exited at start (seen in CI
/// twice: `five_members_and_two_backups_…`, "Address already in use").
fn reserve(port: u16) -> bool {
    let dir = std::env::temp_dir().join("ringmq-test-ports");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(port.to_string());
    let stale = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .is_ok_and(|at| at.elapsed().is_ok_and(|age| age > PORT_RESERVATION));
    if stale {
        let _ = std::fs::remove_file(&path);
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .is_ok()
}

/// A free 127.0.0.1 port from [`TEST_PORTS`], picked at random, checked by binding it, then
/// released — and reserved (see [`reserve`]) so that no other test is handed it meanwhile.
pub fn free_port() -> u16 {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
        ^ (u64::from(std::process::id()) << 32)
        ^ (u64::from(CALLS.fetch_add(1, Ordering::Relaxed)) << 48);
    for pick in 1..=10_000u64 {
        // splitmix64: well-spread picks from the process, the clock and the call.
        let mut z = seed.wrapping_add(pick.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let span = u64::from(TEST_PORTS.end - TEST_PORTS.start);
        let port = TEST_PORTS.start + u16::try_from(z % span).expect("within the span");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() && reserve(port) {
            return port;
        }
    }
    panic!("no free 127.0.0.1 port in {TEST_PORTS:?}")
}

impl Broker {
    /// Starts a broker with the default configuration.
    pub fn start() -> Self {
        Self::start_with_config("")
    }

    /// Starts a broker with this YAML configuration (the listen address is always overridden
    /// to 127.0.0.1:0).
    pub fn start_with_config(yaml: &str) -> Self {
        let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
        let data_dir = std::env::temp_dir().join(format!("ringmq-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);
        std::fs::create_dir_all(&data_dir).expect("temp dir is writable");
        std::fs::write(data_dir.join("ringmq.yaml"), yaml).expect("temp dir is writable");
        Self::spawn(data_dir)
    }

    /// The broker's state directory (`--data-dir`), inside [`Broker::data_dir`].
    pub fn state_dir(&self) -> PathBuf {
        self.data_dir.join("data")
    }

    /// Stops the broker with SIGKILL — a crash at whatever point it was — and starts it
    /// again on the same data directory (on new ports, unless it was started on fixed ones).
    pub fn crash_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.respawn();
    }

    /// Stops the broker with SIGKILL and waits for it to be gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a killed broker again on its data directory with a new configuration (a
    /// restarted cluster member lists the live members as seeds).
    pub fn restart_with_config(&mut self, yaml: &str) {
        self.kill();
        std::fs::write(self.data_dir.join("ringmq.yaml"), yaml).expect("temp dir is writable");
        self.respawn();
    }

    /// Stops the broker with SIGTERM (a clean shutdown) and starts it again on the same data
    /// directory.
    pub fn stop_and_restart(&mut self) {
        self.terminate();
        self.respawn();
    }

    /// Sends SIGTERM and waits (at most 10 s, then SIGKILL) for the broker to exit.
    pub fn terminate(&mut self) {
        // SAFETY: signalling a child process this struct owns.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a broker with this YAML on fixed `ports` (`--amqp-listen`, `--admin-listen` and
    /// `--cluster-listen` override the YAML), in a new data directory. Unlike
    /// [`Broker::start_with_config`] it does not wait for the `listening` lines (a cluster
    /// member may print them, or not, long before it is ready): it returns once the admin
    /// port accepts TCP connections, the process exited, or 30 s passed. Readiness is the
    /// caller's to poll (`/readyz`). Restart it with [`Broker::start_again`].
    pub fn start_on_ports(yaml: &str, ports: Ports) -> Self {
        let n = NEXT_DIR.fetch_add(1, Ordering::Relaxed);
        let data_dir = std::env::temp_dir().join(format!("ringmq-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data_dir);
        std::fs::create_dir_all(&data_dir).expect("temp dir is writable");
        std::fs::write(data_dir.join("ringmq.yaml"), yaml).expect("temp dir is writable");
        Self::spawn_on_ports(data_dir, ports, &[])
    }

    /// Kills the broker (SIGKILL, if it still runs) and starts it again on the same data
    /// directory, configuration and (for [`Broker::start_on_ports`]) ports — the same
    /// cluster member coming back. Returns as [`Broker::start_on_ports`] does.
    pub fn start_again(&mut self) {
        self.kill();
        self.respawn();
    }

    /// Like [`Broker::start_again`] (fixed ports), with `args` added to this start only: a
    /// one-shot flag such as `--cluster-force-boot`.
    pub fn start_again_with(&mut self, args: &[&str]) {
        self.kill();
        let data_dir = std::mem::take(&mut self.data_dir);
        let ports = self.fixed.expect("started with start_on_ports");
        *self = Self::spawn_on_ports(data_dir, ports, args);
    }

    /// Starts the (stopped) process again on its data directory, on its fixed ports if it
    /// has them, else on new ones.
    fn respawn(&mut self) {
        let data_dir = std::mem::take(&mut self.data_dir);
        *self = match self.fixed {
            Some(ports) => Self::spawn_on_ports(data_dir, ports, &[]),
            None => Self::spawn(data_dir),
        };
    }

    /// Sends `signal` to the broker process (by its PID).
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: signalling a child process this struct owns (and has not reaped).
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({}, {signal})", self.child.id());
    }

    /// Freezes the broker (SIGSTOP): to its peers it is silent, its sockets stay open.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a paused broker run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// The exit status, if the process has exited.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last `n` lines of its log (stderr, and stdout lines prefixed `stdout: ` for a
    /// broker started on fixed ports), for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().expect("log lock");
        log[log.len().saturating_sub(n)..].join("\n")
    }

    fn command(data_dir: &Path) -> Command {
        let config = data_dir.join("ringmq.yaml");
        let yaml_sets_iterations =
            std::fs::read_to_string(&config).is_ok_and(|y| y.contains("password_hash_iterations"));
        let mut cmd = Command::new(binary("ringmq-broker"));
        cmd.arg("--data-dir")
            .arg(data_dir.join("data"))
            .arg("--config")
            .arg(&config)
            .env("RINGMQ_LOG", "info,openraft=warn")
            // A member that fails shows why in the last lines of its log, not a backtrace.
            .env("RUST_BACKTRACE", "0")
            .env("RUST_LIB_BACKTRACE", "0")
            // The default PBKDF2 cost (600,000 iterations) takes over a second per password
            // in a debug build; a test that cares sets password_hash_iterations in its YAML.
            .envs((!yaml_sets_iterations).then(|| {
                let n = std::env::var("RINGMQ_PASSWORD_HASH_ITERATIONS")
                    .unwrap_or_else(|_| TEST_HASH_ITERATIONS.to_string());
                ("RINGMQ_PASSWORD_HASH_ITERATIONS", n)
            }))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn spawn_on_ports(data_dir: PathBuf, ports: Ports, extra_args: &[&str]) -> Self {
        let mut child = Self::command(&data_dir)
            .arg("--amqp-listen")
            .arg(ports.amqp.to_string())
            .arg("--admin-listen")
            .arg(ports.admin.to_string())
            .arg("--cluster-listen")
            .arg(ports.cluster.to_string())
            .args(extra_args)
            .spawn()
            .expect("the broker binary starts");
        let log = capture_stderr(&mut child);
        let stdout = child.stdout.take().expect("piped");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in lossy_lines(stdout) {
                sink.lock()
                    .expect("log lock")
                    .push(format!("stdout: {line}"));
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline
            && matches!(child.try_wait(), Ok(None))
            && std::net::TcpStream::connect_timeout(&ports.admin, Duration::from_millis(200))
                .is_err()
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        Broker {
            child,
            addr: ports.amqp,
            amqps: None,
            admin: ports.admin,
            data_dir,
            log,
            cluster: Some(ports.cluster.to_string()),
            fixed: Some(ports),
        }
    }

    /// Runs the broker binary on `data_dir` (holding `ringmq.yaml`), waiting for its address.
    fn spawn(data_dir: PathBuf) -> Self {
        let config = data_dir.join("ringmq.yaml");
        let mut child = Self::command(&data_dir)
            .args([
                "--amqp-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .spawn()
            .expect("the broker binary starts");
        let log = capture_stderr(&mut child);
        // Lines: `amqp=` (unless the plaintext listener is off), `amqps=` (with TLS), and
        // `admin=` last.
        let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
        let (mut amqp, mut amqps, mut admin) = (None, None, None);
        for _ in 0..3 {
            let mut line = String::new();
            stdout
                .read_line(&mut line)
                .expect("the broker prints its addresses");
            let parse = |prefix: &str| -> Option<SocketAddr> {
                let addr = line.trim().strip_prefix(prefix)?;
                Some(addr.parse().expect("a socket address"))
            };
            if let Some(a) = parse("ringmq-broker listening amqp=") {
                amqp = Some(a);
            } else if let Some(a) = parse("ringmq-broker listening amqps=") {
                amqps = Some(a);
            } else if let Some(a) = parse("ringmq-broker listening admin=") {
                admin = Some(a);
                break;
            } else {
                panic!(
                    "unexpected line from the broker: {line:?}; log: {:?}",
                    log.lock().unwrap()
                );
            }
        }
        let clustered =
            std::fs::read_to_string(&config).is_ok_and(|yaml| yaml.contains("cluster_listen"));
        let cluster = clustered.then(|| {
            let mut cluster_line = String::new();
            stdout
                .read_line(&mut cluster_line)
                .expect("a cluster member prints its cluster address");
            cluster_line
                .trim()
                .strip_prefix("ringmq-broker listening cluster=")
                .unwrap_or_else(|| panic!("unexpected line after admin=: {cluster_line:?}"))
                .to_owned()
        });
        // Keep the pipe open (and drained) for as long as the broker runs.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let admin = admin.expect("the broker prints its admin address last");
        let addr = amqp
            .or(amqps)
            .expect("the broker prints at least one AMQP address");
        Broker {
            child,
            addr,
            amqps,
            admin,
            data_dir,
            log,
            cluster,
            fixed: None,
        }
    }

    /// `amqp://guest:guest@ADDR/%2f`.
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// A lapin connection as guest. A cluster member that is not ready or stopped serving
    /// (its lease lapsed while a failure is being settled, or on a loaded machine: it refuses
    /// with 320) is asked again for up to [`NOT_READY_PATIENCE`], as a client would; any other
    /// refusal fails at once.
    pub async fn connect(&self) -> lapin::Connection {
        let deadline = std::time::Instant::now() + NOT_READY_PATIENCE;
        loop {
            match lapin::Connection::connect(&self.uri(), lapin::ConnectionProperties::default())
                .await
            {
                Ok(c) => return c,
                Err(e)
                    if self.cluster.is_some()
                        && reply_code(&e) == Some(320)
                        && ["not ready", "stopped serving"]
                            .iter()
                            .any(|why| e.to_string().contains(why))
                        && std::time::Instant::now() < deadline =>
                {
                    eprintln!("{}: {e}; asking again", self.addr);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("connecting to the test broker: {e:?}"),
            }
        }
    }

    /// A lapin connection and one channel.
    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn = self.connect().await;
        let ch = conn.create_channel().await.expect("opening a channel");
        (conn, ch)
    }

    /// `http://ADMIN_ADDR`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// An admin API client logged in as `user`.
    pub fn admin_as(&self, user: &str, password: &str) -> ringmq::admin_client::AdminClient {
        ringmq::admin_client::AdminClient::new(&self.admin_url(), Some(user), Some(password))
    }

    /// An admin API client logged in as guest (an administrator).
    pub fn admin_client(&self) -> ringmq::admin_client::AdminClient {
        self.admin_as("guest", "guest")
    }

    /// Waits until `/readyz` answers 200 (a restarted cluster member listens before it has
    /// caught up, and refuses clients with 320 until then); panics after `limit` with the
    /// last answer.
    pub fn wait_ready(&self, limit: Duration) {
        let admin = ringmq::admin_client::AdminClient::new(&self.admin_url(), None, None);
        let deadline = std::time::Instant::now() + limit;
        loop {
            let answer = admin.get("/readyz");
            if answer.as_ref().is_ok_and(|a| a.status == 200) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "broker not ready within {limit:?}: {answer:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process id (to kill it from a test).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every thread's stack, trimmed to the project's frames and the lock and wait calls
    /// under them, for the failure message of a broker that stopped answering: a hang in
    /// CI is then a stack to read, not a guess. Needs `gdb` (scripts/test installs it).
    pub fn thread_stacks(&self) -> String {
        let out = Command::new("timeout")
            .args(["60", "gdb", "-p", &self.pid().to_string(), "-batch", "-nx"])
            .args(["-ex", "set pagination off", "-ex", "thread apply all bt"])
            .stdin(Stdio::null())
            .output();
        let out = match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => return format!("gdb failed ({}): {}", o.status, tail_of(&o.stderr)),
            Err(e) => return format!("no gdb to show the threads' stacks: {e}"),
        };
        let mut trimmed = String::new();
        let mut kept = 0;
        for line in out.lines() {
            if line.starts_with("Thread ") {
                kept = 0;
            } else if kept >= 8 || !STACK_WORDS.iter().any(|w| line.contains(w)) {
                continue;
            } else {
                kept += 1;
            }
            let line = line.split(" at /").next().unwrap_or(line);
            trimmed.extend(line.chars().take(200));
            trimmed.push('\n');
        }
        trimmed
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Whether some log line contains `needle`, waiting up to `timeout` for it.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if self
                .log
                .lock()
                .expect("log lock")
                .iter()
                .any(|l| l.contains(needle))
            {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.data_dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.data_dir);
        }
    }
}

/// Collects the broker's stderr lines (its log) in the background, for `log_tail` and
/// failure messages.
fn capture_stderr(child: &mut Child) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let stderr = child.stderr.take().expect("piped");
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lossy_lines(stderr) {
            sink.lock().expect("log lock").push(line);
        }
    });
    log
}

/// What a stack frame in [`Broker::thread_stacks`] must mention to be kept: the project's
/// own code, and the lock, wait and sync calls a hang sits in.
const STACK_WORDS: [&str; 6] = [
    "ringmq::",
    "futex",
    "RwLock",
    "Mutex",
    "epoll_wait",
    "fsync",
];

/// The last lines of a tool's stderr, for a message saying why it failed.
fn tail_of(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// The lines of `pipe` until it closes or fails, bytes that are not UTF-8 replaced: a log
/// line the strict reader would reject must not end the capture and leave a failure message
/// without the broker's last words. A read error ends the lines with a line saying so.
fn lossy_lines(pipe: impl std::io::Read) -> impl Iterator<Item = String> {
    let mut reader = BufReader::new(pipe);
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed {
            return None;
        }
        let mut line = Vec::new();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => None,
            Ok(_) => {
                if line.last() == Some(&b'\n') {
                    line.pop();
                }
                Some(String::from_utf8_lossy(&line).into_owned())
            }
            Err(e) => {
                failed = true;
                Some(format!(
                    "(the test harness could not read this pipe further: {e})"
                ))
            }
        }
    })
}

/// The AMQP reply code inside a lapin error, if the broker sent one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// Sends `frames` on a fresh raw connection (channel 1 open) and returns the reply code of
/// the channel.close the broker answers with. Raw, because lapin reports a server's
/// channel.close that arrives before the test's next call as a bare state error, losing
/// the code the test wants to check.
pub async fn channel_close_code_after(broker: &Broker, frames: &[u8]) -> u16 {
    use tokio::io::AsyncWriteExt;
    let target = ringmq::client::Target::parse(&broker.uri()).expect("the harness URI parses");
    let mut c = ringmq::client::RawClient::connect(&target)
        .await
        .expect("raw handshake");
    c.stream.write_all(frames).await.expect("the broker reads");
    let wait = async {
        loop {
            match c.read_method().await {
                Err(ringmq::client::ClientError::Closed {
                    scope: "channel",
                    code,
                    ..
                }) => return code,
                Err(e) => panic!("expected channel.close, got {e}"),
                Ok(_) => continue,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("channel.close within 5 s")
}

/// A basic.publish with content on channel 1, for [`channel_close_code_after`].
pub fn publish_frames(
    exchange: &str,
    routing_key: &str,
    properties: &ringmq::amqp::Properties,
    body: &[u8],
) -> Vec<u8> {
    use ringmq::amqp::{AMQPClass, basic};
    let mut w = ringmq::amqp::writer::FrameWriter::default();
    w.method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            mandatory: false,
            immediate: false,
        })),
    );
    w.header_payload(
        1,
        &ringmq::amqp::writer::FrameWriter::encode_header_payload(body.len() as u64, properties),
    );
    w.body(1, body, 131_072);
    w.as_slice().to_vec()
}

/// Declare arguments that dead-letter a queue's messages into `dlq` (through the default
/// exchange) with `x-dead-letter-strategy` = `strategy`.
pub fn dead_letter_args(dlq: &str, strategy: &str) -> lapin::types::FieldTable {
    let mut args = lapin::types::FieldTable::default();
    for (k, v) in [
        ("x-dead-letter-exchange", ""),
        ("x-dead-letter-routing-key", dlq),
        ("x-dead-letter-strategy", strategy),
    ] {
        args.insert(k.into(), lapin::types::AMQPValue::LongString(v.into()));
    }
    args
}

/// Ready messages in `queue` (a passive declare).
pub async fn depth(ch: &lapin::Channel, queue: &str) -> u32 {
    queue_counts(ch, queue).await.expect("the queue exists").0
}

/// (ready messages, consumers) of `queue` from a passive declare on `ch`, or the reply code
/// it was refused with (404 for no such queue; the channel is closed then).
pub async fn queue_counts(ch: &lapin::Channel, queue: &str) -> Result<(u32, u32), Option<u16>> {
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), passive, Default::default())
        .await
        .map(|q| (q.message_count(), q.consumer_count()))
        .map_err(|e| reply_code(&e))
}

/// Waits until `queue` is gone from `broker` (a passive declare on a fresh channel answers
/// 404), for at most `limit`; panics with the last answer.
pub async fn wait_queue_gone(broker: &Broker, queue: &str, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let (_c, ch) = broker.channel().await;
        let answer = queue_counts(&ch, queue).await;
        if answer == Err(Some(404)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "queue '{queue}' still on {} after {limit:?}: {answer:?}",
            broker.addr
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Takes every ready message of `queue` with basic.get (no-ack), bodies as UTF-8 text.
pub async fn bodies(ch: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
    {
        out.push(String::from_utf8(m.delivery.data.clone()).expect("UTF-8 body"));
    }
    out
}

/// One raw frame: type, channel, payload and frame-end, for tests that speak bytes.
pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![kind];
    v.extend_from_slice(&channel.to_be_bytes());
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v.push(0xCE);
    v
}
