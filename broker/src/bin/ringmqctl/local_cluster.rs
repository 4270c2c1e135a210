//! `ringmqctl local-cluster`: N brokers on loopback as one cluster, for trying ringmq out on
//! one machine. The first member founds the cluster; each next one is admitted through the
//! members started before it. Ctrl-C (or SIGTERM) stops them all, each by its PID.

use anyhow::{Context, bail};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `local-cluster`.
#[derive(Debug, clap::Args)]
pub struct LocalClusterArgs {
    /// How many brokers (1–9).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=9))]
    members: u16,
    /// AMQP port of the first member; member i listens on P+i for AMQP, P+10000+i for the
    /// admin API and P+20000+i for the cluster port (RabbitMQ's 5672/15672/25672 layout).
    /// 0 lets the OS pick every port (the printed addresses tell which).
    #[arg(long, default_value_t = 5672)]
    base_port: u16,
    /// Directory holding each member's data dir, log and the shared cluster secret.
    #[arg(long, default_value = "ringmq-local-cluster")]
    data_dir: PathBuf,
    /// Worker threads of each member [default: the machine's cores shared out among the
    /// members, at least one each]. Members on one machine that each took every core would
    /// wake and switch between as many times more threads per message as there are members.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
}

impl LocalClusterArgs {
    /// Worker threads per member: as asked, else the cores shared out among the members.
    fn threads_per_member(&self) -> u16 {
        self.worker_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            shared_cores(cores, self.members)
        })
    }
}

/// `cores` shared out among `members`, at least one each.
fn shared_cores(cores: usize, members: u16) -> u16 {
    u16::try_from(cores / usize::from(members.max(1)))
        .unwrap_or(u16::MAX)
        .max(1)
}

/// One started member.
struct Member {
    name: String,
    child: Child,
    amqp: String,
    admin: String,
    cluster: String,
}

/// Starts the members, prints their addresses and waits for Ctrl-C.
pub fn run(args: LocalClusterArgs) -> anyhow::Result<()> {
    let last = u32::from(args.base_port) + 20_000 + u32::from(args.members);
    if last > u32::from(u16::MAX) {
        bail!(
            "--base-port {} is too high: member ports go up to base + 20000 + members",
            args.base_port
        );
    }
    let broker = broker_binary()?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create {}", args.data_dir.display()))?;
    let secret = ensure_secret(&args.data_dir)?;
    let mut members: Vec<Member> = Vec::new();
    for i in 0..args.members {
        let seeds: Vec<String> = members.iter().map(|m| m.cluster.clone()).collect();
        match start_member(&broker, &args, i, &seeds, &secret) {
            Ok(m) => members.push(m),
            Err(e) => {
                stop_all(&mut members);
                return Err(e);
            }
        }
    }
    println!("ringmq local cluster of {} members:", members.len());
    for m in &members {
        println!(
            "  {:<8} amqp://guest:guest@{}/  admin http://{}  cluster {}",
            m.name, m.amqp, m.admin, m.cluster
        );
    }
    println!(
        "logs and data in {}; Ctrl-C stops every member",
        args.data_dir.display()
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    println!("stopping {} members", members.len());
    stop_all(&mut members);
    Ok(())
}

/// `ringmq-broker` next to this executable (cargo builds both into one directory).
fn broker_binary() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("cannot find this executable's path")?;
    let path = me.with_file_name("ringmq-broker");
    if !path.exists() {
        bail!(
            "{} is missing: build both binaries with `cargo build --release --bins`",
            path.display()
        );
    }
    Ok(path)
}

/// The shared secret file, created with 32 random bytes (hex) on first use.
fn ensure_secret(dir: &Path) -> anyhow::Result<PathBuf> {
    use rand08::RngCore;
    let path = dir.join("cluster-secret");
    if !path.exists() {
        let mut bytes = [0u8; 32];
        rand08::rngs::OsRng.fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(&path, hex)
            .with_context(|| format!("cannot write the cluster secret {}", path.display()))?;
    }
    Ok(path)
}

fn start_member(
    broker: &Path,
    args: &LocalClusterArgs,
    i: u16,
    seeds: &[String],
    secret: &Path,
) -> anyhow::Result<Member> {
    let name = format!("node-{i}");
    let dir = args.data_dir.join(&name);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let log_path = dir.join("broker.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let port = |offset: u16| match args.base_port {
        0 => "127.0.0.1:0".to_owned(),
        base => format!("127.0.0.1:{}", base + offset + i),
    };
    let mut cmd = Command::new(broker);
    cmd.arg("--amqp-listen")
        .arg(port(0))
        .arg("--admin-listen")
        .arg(port(10_000))
        .arg("--cluster-listen")
        .arg(port(20_000))
        .arg("--cluster-secret-file")
        .arg(secret)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--node-id")
        .arg(&name)
        .arg("--worker-threads")
        .arg(args.threads_per_member().to_string())
        .stdout(Stdio::piped())
        .stderr(log);
    if !seeds.is_empty() {
        cmd.arg("--cluster-seeds").arg(seeds.join(","));
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", broker.display()))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (mut amqp, mut admin, mut cluster) = (None, None, None);
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{name} did not start within 60 s (or exited): see {}",
                log_path.display()
            );
        };
        let value = |key: &str| line.strip_prefix(key).map(str::to_owned);
        amqp = amqp.or(value("ringmq-broker listening amqp="));
        admin = admin.or(value("ringmq-broker listening admin="));
        cluster = cluster.or(value("ringmq-broker listening cluster="));
    }
    Ok(Member {
        name,
        child,
        amqp: amqp.unwrap_or_default(),
        admin: admin.unwrap_or_default(),
        cluster: cluster.unwrap_or_default(),
    })
}

/// SIGTERM to each member (a clean shutdown writes its journal), then SIGKILL after 10 s.
fn stop_all(members: &mut [Member]) {
    for m in members.iter() {
        // SAFETY: signalling a child process this tool started and still owns.
        unsafe { libc::kill(m.child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for m in members.iter_mut() {
        while matches!(m.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(m.child.try_wait(), Ok(None)) {
            eprintln!("{} did not stop within 10 s: killing it", m.name);
            let _ = m.child.kill();
        }
        let _ = m.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::shared_cores;

    #[test]
    fn members_share_the_cores_and_each_gets_at_least_one() {
        assert_eq!(shared_cores(2, 3), 1);
        assert_eq!(shared_cores(8, 3), 2);
        assert_eq!(shared_cores(16, 1), 16);
        assert_eq!(shared_cores(1, 9), 1);
    }
}
