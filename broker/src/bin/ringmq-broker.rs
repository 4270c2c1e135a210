//! `ringmq-broker`: runs one broker. With no options it listens on 127.0.0.1:5672 with user
//! guest/guest (loopback only) and vhost `/`.

use anyhow::Context;
use clap::Parser;
use ringmq::config::Config;
use std::net::SocketAddr;
use std::path::PathBuf;

/// A clustered AMQP 0-9-1 message broker.
#[derive(Debug, Parser)]
#[command(name = "ringmq-broker", version, about)]
struct Args {
    /// AMQP listener address [default: 127.0.0.1:5672].
    #[arg(long, env = "RINGMQ_AMQP_LISTEN", value_name = "ADDR")]
    amqp_listen: Option<SocketAddr>,
    /// TLS (amqps) listener address; needs --tls-cert and --tls-key [default: none].
    #[arg(long, env = "RINGMQ_AMQPS_LISTEN", value_name = "ADDR")]
    amqps_listen: Option<SocketAddr>,
    /// PEM certificate chain of the TLS listener (reloaded when the file changes).
    #[arg(long, env = "RINGMQ_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "RINGMQ_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// PEM CA certificates for client certificates (enables SASL EXTERNAL).
    #[arg(long, env = "RINGMQ_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// Do not open the plaintext AMQP listener (TLS only).
    #[arg(long, env = "RINGMQ_NO_PLAINTEXT")]
    no_plaintext: bool,
    /// Admin HTTP listener (metrics, health, JSON API) [default: 127.0.0.1:15672].
    #[arg(long, env = "RINGMQ_ADMIN_LISTEN", value_name = "ADDR")]
    admin_listen: Option<SocketAddr>,
    /// Directory for the broker's state [default: ./data].
    #[arg(long, env = "RINGMQ_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Threads that run connections and cluster tasks [default: one per core].
    #[arg(long, env = "RINGMQ_WORKER_THREADS", value_name = "N")]
    worker_threads: Option<usize>,
    /// YAML configuration file; command-line flags and RINGMQ_* variables override it.
    #[arg(long, env = "RINGMQ_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// This node's id in the admin API and the cluster [default: ringmq@HOSTNAME].
    #[arg(long, env = "RINGMQ_NODE_ID", value_name = "ID")]
    node_id: Option<String>,
    /// Failure zone of this node (a rack or availability zone): the ring keeps members of
    /// one zone apart, so a queue's backups sit in other zones than its primary.
    #[arg(long, env = "RINGMQ_ZONE", value_name = "ZONE")]
    zone: Option<String>,
    /// A file the zone is read from at start (the zone alone, or a Kubernetes downward API
    /// labels file, whose `topology.kubernetes.io/zone` is taken); waited for up to
    /// `zone_file_wait_s`.
    #[arg(long, env = "RINGMQ_ZONE_FILE", value_name = "FILE")]
    zone_file: Option<PathBuf>,
    /// Where this member goes on the ring when it first joins (see `ring_order` in the
    /// README's configuration table).
    #[arg(long, env = "RINGMQ_RING_ORDER", value_name = "N")]
    ring_order: Option<u32>,
    /// An administrator user to create at start (with --default-pass); how the operator
    /// hands a cluster its default user from a Kubernetes Secret.
    #[arg(
        long,
        env = "RINGMQ_DEFAULT_USER",
        value_name = "NAME",
        requires = "default_pass"
    )]
    default_user: Option<String>,
    /// Password of --default-user.
    #[arg(
        long,
        env = "RINGMQ_DEFAULT_PASS",
        value_name = "PASSWORD",
        hide_env_values = true
    )]
    default_pass: Option<String>,
    /// PBKDF2 iterations for passwords this broker hashes [default: 600000].
    #[arg(long, env = "RINGMQ_PASSWORD_HASH_ITERATIONS", value_name = "N")]
    password_hash_iterations: Option<u32>,
    /// Cluster port: makes this broker a cluster member.
    #[arg(long, env = "RINGMQ_CLUSTER_LISTEN", value_name = "ADDR")]
    cluster_listen: Option<SocketAddr>,
    /// Members to ask for admission (comma-separated `host:port`); none founds a cluster.
    #[arg(
        long,
        env = "RINGMQ_CLUSTER_SEEDS",
        value_name = "A,B,C",
        value_delimiter = ','
    )]
    cluster_seeds: Vec<String>,
    /// File with the shared cluster secret.
    #[arg(long, env = "RINGMQ_CLUSTER_SECRET_FILE", value_name = "FILE")]
    cluster_secret_file: Option<PathBuf>,
    /// Host other members and clients reach this broker at (when listening on 0.0.0.0).
    #[arg(long, env = "RINGMQ_ADVERTISE_HOST", value_name = "HOST")]
    advertise_host: Option<String>,
    /// Start a new cluster from this member's state alone, for the day a majority of the
    /// cluster is lost for good. Changes the lost members committed that this one had not
    /// applied are gone; every other survivor must empty its `<data-dir>/cluster` and join
    /// this member. The old cluster state is kept aside as `cluster.before-force-boot-<time>`.
    #[arg(long, env = "RINGMQ_CLUSTER_FORCE_BOOT")]
    cluster_force_boot: bool,
    /// Log filter in RUST_LOG syntax [default: info].
    #[arg(long, env = "RINGMQ_LOG", value_name = "FILTER")]
    log: Option<String>,
    /// Log format.
    #[arg(long, env = "RINGMQ_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Parse the configuration (file, environment, flags) exactly as a start would, print a
    /// one-line summary and exit 0, or exit 1 with the reason; opens no listener and writes
    /// nothing (files the config names, such as the cluster secret, are not read).
    #[arg(long)]
    check_config: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let force_boot = args.cluster_force_boot;
    // openraft logs every vote and append at info; its warnings are what an operator needs.
    let filter =
        tracing_subscriber::EnvFilter::try_new(args.log.as_deref().unwrap_or("info,openraft=warn"))
            .context("--log is not a valid filter (example: info,ringmq=debug)")?;
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => subscriber.init(),
        LogFormat::Json => subscriber.json().init(),
    }
    if args.check_config {
        match load_config(args) {
            Ok(config) => {
                println!("ringmq-broker: configuration OK: {}", summary(&config));
                return Ok(());
            }
            Err(e) => {
                eprintln!(
                    "ringmq-broker: configuration refused: {e:#}\n\
                     (every config key and flag is listed in README.md, \"Configuration\"; \
                     `ringmq-broker --help` lists the flags)"
                );
                std::process::exit(1);
            }
        }
    }
    let mut config = load_config(args)?;
    config.read_zone_file();
    raise_open_file_limit();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = config.worker_threads {
        runtime.worker_threads(threads);
    }
    let runtime = runtime.enable_all().build()?;
    runtime.block_on(async move {
        let running = ringmq::server::start(config.clone()).await?;
        tracing::info!(amqp = ?running.amqp_addr, amqps = ?running.amqps_addr, data_dir = %config.data_dir.display(), "ringmq-broker ready");
        let admin_addr = ringmq::admin::start(running.broker.clone(), config.admin_listen)
            .await
            .with_context(|| format!("cannot listen on {} (admin)", config.admin_listen))?;
        tracing::info!(admin = %admin_addr, "admin listener ready");
        let cluster = match config.cluster_listen {
            Some(listen) => {
                Some(join_cluster(&running, &config, listen, admin_addr, force_boot).await?)
            }
            None => None,
        };
        // Machine-readable lines for scripts and tests that start the broker on port 0.
        // Order: amqp= (unless --no-plaintext), amqps= (when TLS is on), admin= always last.
        if let Some(addr) = running.amqp_addr {
            println!("ringmq-broker listening amqp={addr}");
        }
        if let Some(addr) = running.amqps_addr {
            println!("ringmq-broker listening amqps={addr}");
        }
        println!("ringmq-broker listening admin={admin_addr}");
        if let Some(cluster) = &cluster {
            println!("ringmq-broker listening cluster={}", cluster.addr());
        }
        let signal = shutdown_signal().await;
        // What `POST /api/members/{id}/leave` does: /readyz answers 503 from now on. The
        // pod's stop is this signal (the image has no shell for a pre-stop hook); the other
        // members see this one go when its cluster link closes.
        running
            .broker
            .registry
            .leaving
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!(member = %config.node_id, signal, "leaving: /readyz answers 503");
        if let Some(cluster) = &cluster {
            leave_cluster(cluster).await;
        }
        tracing::info!(member = %config.node_id, "shutting down: writing the journal");
        running.broker.journal.shutdown();
        anyhow::Ok(())
    })
}

/// A drained member that holds nothing leaves the cluster for good on its way out (the
/// others stop counting its vote); any other member stays a voter, its stop a restart.
async fn leave_cluster(cluster: &ringmq::cluster::Cluster) {
    use ringmq::cluster::Retirement;
    match cluster.retire_if_drained().await {
        Ok(Retirement::Retired) => {
            tracing::info!("drained: left the cluster for good (no longer a voter)");
        }
        Ok(Retirement::NotDrained) => {
            tracing::info!("not drained: stays a voter, and rejoins as the same one on restart");
        }
        Ok(Retirement::StillHolds(held)) => tracing::warn!(
            primaries = held.primaries,
            backups = held.backups,
            "drained but still holding queue copies: stays a voter (the drain has not finished)"
        ),
        Ok(Retirement::LastVoter) => {
            tracing::info!("drained, but the cluster's last voter: stays one");
        }
        Err(e) => {
            tracing::warn!(error = %e, "drained, but could not leave the cluster for good: stays a voter until it is started and stopped again")
        }
    }
}

/// The configuration a start uses: the file (`--config`), then each flag or `RINGMQ_*`
/// variable over it, then the range checks. One function, so that `--check-config` refuses
/// exactly what a start would.
fn load_config(args: Args) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    if let Some(addr) = args.amqp_listen {
        config.amqp_listen = addr;
    }
    if let Some(addr) = args.amqps_listen {
        config.amqps_listen = Some(addr);
    }
    if let Some(file) = args.tls_cert {
        config.tls_cert_file = Some(file);
    }
    if let Some(file) = args.tls_key {
        config.tls_key_file = Some(file);
    }
    if let Some(file) = args.tls_ca {
        config.tls_ca_file = Some(file);
    }
    if let Some(n) = args.password_hash_iterations {
        config.password_hash_iterations = n;
    }
    if args.no_plaintext {
        config.amqp_listen_enabled = false;
    }
    if let Some(addr) = args.admin_listen {
        config.admin_listen = addr;
    }
    if let Some(dir) = args.data_dir {
        config.data_dir = dir;
    }
    if let Some(threads) = args.worker_threads {
        config.worker_threads = Some(threads);
    }
    if let Some(addr) = args.cluster_listen {
        config.cluster_listen = Some(addr);
    }
    if !args.cluster_seeds.is_empty() {
        config.cluster_seeds = args.cluster_seeds;
    }
    if let Some(file) = args.cluster_secret_file {
        config.cluster_secret_file = Some(file);
    }
    if let Some(host) = args.advertise_host {
        config.advertise_host = Some(host);
    }
    if let Some(zone) = args.zone {
        config.zone = zone;
    }
    if let Some(file) = args.zone_file {
        config.zone_file = Some(file);
    }
    if let Some(order) = args.ring_order {
        config.ring_order = Some(order);
    }
    if let Some(id) = args.node_id {
        config.node_id = id;
    }
    if let (Some(name), Some(password)) = (args.default_user, args.default_pass) {
        config.users.retain(|u| u.name != name);
        config.users.push(ringmq::config::UserConfig {
            name,
            password: Some(password),
            password_hash: None,
            loopback_only: false,
            vhosts: Vec::new(),
            permissions: Default::default(),
            tags: vec!["administrator".to_owned()],
        });
    }
    config.validate()?;
    Ok(config)
}

/// One line saying what a start with `config` would do, for `--check-config`.
fn summary(config: &Config) -> String {
    let amqp = if config.amqp_listen_enabled {
        config.amqp_listen.to_string()
    } else {
        "off".to_owned()
    };
    let amqps = config
        .amqps_listen
        .map_or_else(|| "off".to_owned(), |a| a.to_string());
    let cluster = match config.cluster_listen {
        Some(listen) => format!(
            "member on {listen} ({} seeds{})",
            config.cluster_seeds.len(),
            config
                .cluster_founder
                .as_deref()
                .map_or_else(String::new, |f| format!(", founder {f}"))
        ),
        None => "standalone".to_owned(),
    };
    format!(
        "node {}, amqp {amqp}, amqps {amqps}, admin {}, data dir {}, cluster: {cluster}, \
         {} vhosts, {} users",
        config.node_id,
        config.admin_listen,
        config.data_dir.display(),
        config.vhosts.len(),
        config.users.len()
    )
}

/// Joins (or founds) the cluster and lets the listeners serve once this member holds the
/// cluster map.
async fn join_cluster(
    running: &ringmq::server::Running,
    config: &Config,
    listen: SocketAddr,
    admin_addr: SocketAddr,
    force_boot: bool,
) -> anyhow::Result<std::sync::Arc<ringmq::cluster::Cluster>> {
    let dir = config.data_dir.join("cluster");
    let mut seeds = config.cluster_seeds.clone();
    if force_boot {
        set_cluster_state_aside(&dir)?;
        seeds.clear();
    }
    let secret_file = config
        .cluster_secret_file
        .as_ref()
        .context("--cluster-secret-file is required with --cluster-listen")?;
    let secret = std::fs::read(secret_file)
        .with_context(|| format!("cannot read the cluster secret {}", secret_file.display()))?;
    let secret = secret.trim_ascii().to_vec();
    anyhow::ensure!(
        !secret.is_empty(),
        "the cluster secret file {} is empty",
        secret_file.display()
    );
    let advertised = |addr: SocketAddr| match &config.advertise_host {
        Some(host) => format!("{host}:{}", addr.port()),
        None => addr.to_string(),
    };
    let settings = ringmq::cluster::ClusterSettings {
        listen,
        advertise: config
            .advertise_host
            .as_ref()
            .map(|h| format!("{h}:{}", listen.port())),
        seeds,
        secret,
        failure_timeout_ms: config.cluster_failure_timeout_ms,
        info: ringmq::cluster::MemberInfo {
            node_id: config.node_id.clone(),
            // Clients are told the plaintext address, or the TLS one when there is no other.
            amqp: advertised(
                running
                    .amqp_addr
                    .or(running.amqps_addr)
                    .context("a cluster member needs an AMQP listener")?,
            ),
            admin: advertised(admin_addr),
            zone: config.zone.clone(),
            default_backups: config.default_backups,
            ring_order: config.ring_order,
            places_ring: true,
            lays_out_ring: true,
            holds_for_sessions: true,
            process: rand08::random::<u64>().max(1),
        },
        join_timeout: std::time::Duration::from_millis(config.cluster_join_timeout_ms),
        found_if_no_seed_answers: config.cluster_founder.as_deref() == Some(&config.node_id),
        dir,
    };
    let cluster = ringmq::cluster::Cluster::start(
        ringmq::broker::cluster_host::BrokerHost::new(running.broker.clone()),
        settings,
    )
    .await
    .with_context(|| format!("cannot join the cluster on {listen}"))?;
    running.broker.joined(cluster.clone());
    ringmq::broker::majority::spawn_guard(running.broker.clone(), cluster.clone());
    ringmq::broker::drain::spawn_guard(running.broker.clone(), cluster.clone());
    ringmq::broker::fragments::spawn(&running.broker, cluster.clone());
    running.broker.start_serving();
    Ok(cluster)
}

/// `--cluster-force-boot`: moves this member's cluster state aside so that it founds a new
/// cluster from its own wiring and messages, and says loudly what that costs.
fn set_cluster_state_aside(dir: &std::path::Path) -> anyhow::Result<()> {
    if !dir.exists() {
        tracing::warn!(
            "--cluster-force-boot: this member has no cluster state; founding a new cluster"
        );
        return Ok(());
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let aside = dir.with_file_name(format!("cluster.before-force-boot-{secs}"));
    std::fs::rename(dir, &aside)
        .with_context(|| format!("--cluster-force-boot: cannot move {} aside", dir.display()))?;
    tracing::error!(
        kept = %aside.display(),
        "FORCE BOOT: founding a new cluster from this member's state alone. Wiring changes the \
         old cluster committed that this member had not applied are LOST, and so are the \
         messages held only by members that do not come back. Every other surviving member \
         must empty its <data-dir>/cluster directory and join this member (--cluster-seeds)."
    );
    Ok(())
}

/// Raises the soft limit on open files to the hard limit: every connection is a descriptor,
/// and distributions often default the soft limit to 1024.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            let wanted = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) != 0 {
                tracing::warn!(soft = limit.rlim_cur, "could not raise the open-file limit");
            }
        }
    }
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM (`docker stop`, a pod's deletion) and names it.
async fn shutdown_signal() -> &'static str {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler cannot fail on Unix");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}
