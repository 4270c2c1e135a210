//! The operator binary: runs the controllers (on the replica that holds the leader Lease)
//! and serves `/metrics` and `/healthz` (on every replica).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ringmq_operator::admin::HttpConnectorFactory;
use ringmq_operator::controller::{self, Context};
use ringmq_operator::leader::{self, LeaderConfig};
use ringmq_operator::metrics::Metrics;

/// The operator's options; each has an environment variable, which the chart sets.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Kubernetes operator for ringmq: Cluster and Queue controllers"
)]
struct Options {
    /// Watch Clusters and Queues (and the objects they own) in this namespace only; all
    /// namespaces when unset.
    #[arg(long, env = "WATCH_NAMESPACE", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    watch_namespace: Option<String>,
    /// Run the controllers only while holding the Lease `ringmq-operator` (so that several
    /// replicas can run, one active). `false` for a single replica run by hand.
    #[arg(long, env = "LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader Lease: the operator's own; the kubeconfig's or service
    /// account's namespace when unset.
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// This replica's identity in the Lease and in Events: its pod name.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// Listen address of `/metrics` and `/healthz`.
    #[arg(long, env = "METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let options = Options::parse();
    ringmq_operator::telemetry::init();
    let addr = options.metrics_addr;
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes configuration found: run in a cluster or set KUBECONFIG")?;
    let metrics = Arc::new(Metrics::default());
    let ctx = Arc::new(Context::new(
        client.clone(),
        metrics.clone(),
        Arc::new(HttpConnectorFactory::default()),
    ));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    let server = tokio::spawn(serve(listener, metrics));
    let watch_namespace = options.watch_namespace.as_deref();
    match &watch_namespace {
        Some(ns) => tracing::info!(namespace = %ns, "watching one namespace"),
        None => tracing::info!("watching all namespaces"),
    }
    let controllers = controller::run(ctx, watch_namespace);
    let outcome = if options.leader_election {
        let config = LeaderConfig {
            namespace: options
                .lease_namespace
                .unwrap_or_else(|| client.default_namespace().to_string()),
            identity: options
                .pod_name
                .or_else(|| std::env::var("HOSTNAME").ok())
                .context("no identity for the leader Lease: set POD_NAME (the chart does)")?,
        };
        leader::lead(client, &config, controllers)
            .await
            .map_err(anyhow::Error::from)
    } else {
        controllers.await;
        Ok(())
    };
    server.abort();
    outcome
}

async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                async move {
                    let (status, body) = match req.uri().path() {
                        "/metrics" => match metrics.render() {
                            Ok(text) => (200, text),
                            Err(e) => (500, e.to_string()),
                        },
                        "/healthz" => (200, "ok".to_string()),
                        _ => (404, "not found".to_string()),
                    };
                    hyper::Response::builder()
                        .status(status)
                        .header(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )
                        .body(Full::new(Bytes::from(body)))
                }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}
