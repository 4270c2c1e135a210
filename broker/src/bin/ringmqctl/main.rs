//! `ringmqctl`: the command-line tool for ringmq. The admin commands (`status`, `list`,
//! `declare`, `delete`, `purge`, `close`, `definitions`, `cluster`) call the broker's admin
//! HTTP API;
//! `bench` is a load generator in the manner of RabbitMQ's PerfTest that works against any
//! AMQP 0-9-1 broker; `sink` measures the bench tool's own ceiling; `local-cluster` runs a
//! cluster of brokers on one machine.

mod admin;
mod bench;
mod bench_failover;
mod cluster;
mod local_cluster;
mod sink;

use clap::{CommandFactory, Parser, Subcommand};

/// Command-line tool for ringmq.
#[derive(Debug, Parser)]
#[command(name = "ringmqctl", version, about)]
struct Cli {
    #[command(flatten)]
    conn: admin::Conn,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the node, its members, object and message totals.
    Status,
    /// List queues, exchanges, bindings, connections, channels, users, vhosts or permissions.
    List(admin::ListArgs),
    /// Create (or check) a queue, exchange, binding, vhost, user or permission.
    #[command(subcommand)]
    Declare(admin::Declare),
    /// Delete a queue, exchange, binding, vhost, user or permission.
    #[command(subcommand)]
    Delete(admin::Delete),
    /// Remove a queue's ready messages.
    #[command(subcommand)]
    Purge(admin::Purge),
    /// Close a client connection.
    #[command(subcommand)]
    Close(admin::Close),
    /// Export or import definitions (users, vhosts, permissions, queues, exchanges, bindings).
    #[command(subcommand)]
    Definitions(admin::Definitions),
    /// The cluster as a ring: `cluster ring` lists its members in ring order and what each
    /// holds.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Print the stored form of a password (PBKDF2-HMAC-SHA256) for a config file's
    /// `password_hash:` or the admin API; reads the password from stdin when not given.
    HashPassword {
        /// The password (omit it to keep it out of the shell history; one line of stdin).
        password: Option<String>,
        /// PBKDF2 iterations.
        #[arg(long, default_value_t = ringmq::auth::password::DEFAULT_ITERATIONS)]
        iterations: u32,
    },
    /// Print a shell completion script.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Measure throughput and latency of a broker (any AMQP 0-9-1 broker).
    Bench(bench::BenchArgs),
    /// Start N brokers on loopback as one cluster (the quick start); Ctrl-C stops them.
    LocalCluster(local_cluster::LocalClusterArgs),
    /// A stand-in broker that drops publishes and feeds consumers endlessly: run `bench`
    /// against it to measure the load tool's own ceiling.
    Sink(sink::SinkArgs),
}

fn hash_password(password: Option<String>, iterations: u32) -> anyhow::Result<()> {
    use ringmq::auth::password::{MAX_ITERATIONS, MIN_ITERATIONS, PasswordHash};
    anyhow::ensure!(
        (MIN_ITERATIONS..=MAX_ITERATIONS).contains(&iterations),
        "--iterations must be within {MIN_ITERATIONS}..={MAX_ITERATIONS}"
    );
    let password = match password {
        Some(p) => p,
        None => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim_end_matches(['\r', '\n']).to_owned()
        }
    };
    anyhow::ensure!(!password.is_empty(), "the password is empty");
    println!("{}", PasswordHash::new(&password, iterations).encoded());
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let conn = &cli.conn;
    let result = match cli.command {
        Command::Status => admin::status(conn),
        Command::List(args) => admin::list(conn, &args),
        Command::Declare(d) => admin::declare(conn, &d),
        Command::Delete(d) => admin::delete(conn, &d),
        Command::Purge(p) => admin::purge(conn, &p),
        Command::Close(c) => admin::close(conn, &c),
        Command::Definitions(d) => admin::definitions(conn, &d),
        Command::Cluster(c) => cluster::run(conn, &c),
        Command::HashPassword {
            password,
            iterations,
        } => hash_password(password, iterations),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "ringmqctl",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Bench(args) => bench::run(args),
        Command::Sink(args) => sink::run(args),
        Command::LocalCluster(args) => local_cluster::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ringmqctl: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
