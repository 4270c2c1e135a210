//! `ringmqctl`: the command-line tool for ringmq. `bench` is a load generator in the manner of
//! RabbitMQ's PerfTest that works against any AMQP 0-9-1 broker.

mod bench;
mod sink;

use clap::{Parser, Subcommand};

/// Command-line tool for ringmq.
#[derive(Debug, Parser)]
#[command(name = "ringmqctl", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure throughput and latency of a broker (any AMQP 0-9-1 broker).
    Bench(bench::BenchArgs),
    /// A stand-in broker that drops publishes and feeds consumers endlessly: run `bench`
    /// against it to measure the load tool's own ceiling.
    Sink(sink::SinkArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Sink(args) => sink::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ringmqctl: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
