//! The operator binary: runs the controllers and serves `/metrics` and `/healthz`.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ringmq_operator::admin::HttpConnectorFactory;
use ringmq_operator::controller::{self, Context};
use ringmq_operator::metrics::Metrics;

/// Default listen address of the metrics endpoint; `METRICS_ADDR` overrides it.
const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:8080";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    ringmq_operator::telemetry::init();
    let addr: SocketAddr = std::env::var("METRICS_ADDR")
        .unwrap_or_else(|_| DEFAULT_METRICS_ADDR.to_string())
        .parse()
        .context("METRICS_ADDR must be host:port, e.g. 0.0.0.0:8080")?;
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes configuration found: run in a cluster or set KUBECONFIG")?;
    let metrics = Arc::new(Metrics::default());
    let ctx = Arc::new(Context::new(
        client,
        metrics.clone(),
        Arc::new(HttpConnectorFactory::default()),
    ));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    let server = tokio::spawn(serve(listener, metrics));
    controller::run(ctx).await;
    server.abort();
    Ok(())
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
