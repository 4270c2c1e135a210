//! The admin HTTP listener: health (`/healthz`, `/readyz`), Prometheus metrics (`/metrics`,
//! `/metrics/detailed`) and the JSON management API under `/api/` (see `docs/admin-api.md`).
//!
//! Paths follow RabbitMQ's management API; vhost and object names are URL-encoded path
//! segments (`%2F` is the vhost `/`). The API uses HTTP basic auth against the broker's users:
//! the tag `administrator` may do everything, `monitoring` may only read. Every error is a
//! JSON object `{"error": ..., "reason": ...}`.

pub mod definitions;
pub mod json;
pub mod metrics;
mod router;
mod routes;
mod wiring;

use crate::auth::UserRecord;
use crate::broker::Broker;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::net::TcpListener;

/// Admin connections served at once; more wait in the listen backlog.
const MAX_ADMIN_CONNECTIONS: usize = 64;
/// Largest request body (a definitions import of a big broker).
const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Time a client has to send the request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The tag that may do everything.
pub const TAG_ADMINISTRATOR: &str = "administrator";
/// The tag that may read everything.
pub const TAG_MONITORING: &str = "monitoring";

/// Binds the admin listener and serves it; returns the bound address. The broker is marked
/// ready (`/readyz`) from here on.
pub async fn start(broker: Arc<Broker>, addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let _ = broker.registry.admin_addr.set(local);
    broker.registry.ready.store(true, Ordering::Relaxed);
    tokio::spawn(accept_loop(listener, broker));
    Ok(local)
}

async fn accept_loop(listener: TcpListener, broker: Arc<Broker>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let broker = broker.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let broker = broker.clone();
                async move { Ok::<_, Infallible>(handle(&broker, peer, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            drop(permit);
        });
    }
}

/// An HTTP response.
pub type Reply = Response<Full<Bytes>>;

/// An API error: the status and the JSON body `{"error", "reason"}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
}

impl ApiError {
    /// Any status.
    pub fn new(status: StatusCode, error: &'static str, reason: impl Into<String>) -> Self {
        Self {
            status,
            error,
            reason: reason.into(),
        }
    }
    /// 400: the request body or a parameter is wrong.
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }
    /// 404.
    pub fn not_found(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", reason)
    }
    /// 409: an object exists with other properties.
    pub fn conflict(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", reason)
    }
    /// 503: the cluster layer stopped, so a change submitted to it has no answer.
    pub fn cluster_stopped() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the cluster layer stopped",
        )
    }
    /// 403.
    pub fn forbidden(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "access_refused", reason)
    }
    /// Maps an AMQP error from the vhost core to the HTTP status an API client expects.
    pub fn from_amqp(e: crate::core::AmqpError) -> Self {
        use crate::amqp::codes;
        match e.code {
            codes::NOT_FOUND => Self::not_found(e.text),
            codes::ACCESS_REFUSED => Self::forbidden(e.text),
            codes::PRECONDITION_FAILED | codes::RESOURCE_LOCKED => Self::conflict(e.text),
            _ => Self::bad_request(e.text),
        }
    }

    fn into_reply(self) -> Reply {
        let mut r = json_reply(
            self.status,
            &json!({"error": self.error, "reason": self.reason}),
        );
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"ringmq\""),
            );
        }
        r
    }
}

/// A JSON response.
pub fn json_reply(status: StatusCode, v: &Value) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A response without a body.
pub fn empty_reply(status: StatusCode) -> Reply {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = status;
    r
}

fn text_reply(status: StatusCode, content_type: &'static str, body: String) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Who is calling and what they sent.
pub struct Call {
    /// The authenticated user.
    pub user: UserRecord,
    /// HTTP method.
    pub method: Method,
    /// Decoded path segments after `/api/`.
    pub path: Vec<String>,
    /// Query string pairs.
    pub query: Vec<(String, String)>,
    /// The request body (empty if none).
    pub body: Bytes,
}

impl Call {
    /// The body as JSON (`{}` when empty).
    pub fn json(&self) -> Result<Value, ApiError> {
        if self.body.iter().all(u8::is_ascii_whitespace) {
            return Ok(json!({}));
        }
        let v: Value = serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        Ok(v)
    }

    /// A query parameter.
    pub fn query(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn decode(segment: &str) -> String {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8_lossy()
        .into_owned()
}

/// Why `/readyz` answers 503, or `None` when this broker serves: its listeners are up, it
/// is not leaving, and a cluster member has joined and holds the majority's lease and map.
fn not_ready_reason(broker: &Broker) -> Option<String> {
    let r = &broker.registry;
    if r.leaving.load(Ordering::Relaxed) {
        return Some("the node is leaving the cluster".into());
    }
    if let Some(c) = broker.cluster()
        && c.is_draining(c.node_id())
    {
        return Some("the member is being drained: its clients go to the others".into());
    }
    if !r.is_ready() {
        return Some("listeners are not up yet".into());
    }
    match broker.cluster() {
        Some(cluster) => cluster.not_ready_reason(),
        None if broker.config.cluster_listen.is_some() => {
            Some("waiting to join the cluster: not admitted yet".into())
        }
        None => None,
    }
}

async fn handle(broker: &Arc<Broker>, peer: SocketAddr, req: Request<Incoming>) -> Reply {
    let method = req.method().clone();
    let raw_path = req.uri().path().to_owned();
    let get = method == Method::GET || method == Method::HEAD;
    match raw_path.as_str() {
        "/healthz" if get => {
            return json_reply(StatusCode::OK, &json!({"status": "ok"}));
        }
        "/readyz" if get => {
            return match not_ready_reason(broker) {
                None => json_reply(StatusCode::OK, &json!({"status": "ready"})),
                Some(reason) => {
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", reason).into_reply()
                }
            };
        }
        "/metrics" if get => {
            let text = metrics::render(broker, broker.config.metrics_per_queue);
            return text_reply(StatusCode::OK, metrics::CONTENT_TYPE, text);
        }
        "/metrics/detailed" if get => {
            return text_reply(
                StatusCode::OK,
                metrics::CONTENT_TYPE,
                metrics::render(broker, true),
            );
        }
        _ => {}
    }
    let Some(rest) = raw_path.strip_prefix("/api/") else {
        return ApiError::not_found(format!(
            "no such path {raw_path}: the API is under /api/, metrics at /metrics"
        ))
        .into_reply();
    };
    let user = match authenticate(broker, peer, req.headers()) {
        Ok(u) => u,
        Err(e) => return e.into_reply(),
    };
    let is_admin = user.tags.iter().any(|t| t == TAG_ADMINISTRATOR);
    let is_monitor = user.tags.iter().any(|t| t == TAG_MONITORING);
    if !is_admin && !is_monitor {
        return ApiError::forbidden(format!(
            "user '{}' has neither the administrator nor the monitoring tag",
            user.name
        ))
        .into_reply();
    }
    if !get && !is_admin {
        return ApiError::forbidden(format!(
            "user '{}' is tagged monitoring, which is read-only: use an administrator",
            user.name
        ))
        .into_reply();
    }
    let mut path: Vec<String> = rest.split('/').map(decode).collect();
    if path.len() > 1 && path.last().is_some_and(String::is_empty) {
        path.pop();
    }
    let query = req
        .uri()
        .query()
        .map(|q| {
            q.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode(k), decode(v))
                })
                .collect()
        })
        .unwrap_or_default();
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "bad_request",
                format!("the body is larger than {MAX_BODY_BYTES} bytes or was cut off"),
            )
            .into_reply();
        }
    };
    let call = Call {
        user,
        method,
        path,
        query,
        body,
    };
    let reply = match router::dispatch(broker, &call).await {
        Ok(r) => r,
        Err(e) => e.into_reply(),
    };
    if !get {
        // A change made through the API is durable before it is acknowledged, as over AMQP.
        broker.persist_all_and_wait().await;
    }
    reply
}

fn authenticate(
    broker: &Broker,
    peer: SocketAddr,
    headers: &hyper::HeaderMap,
) -> Result<UserRecord, ApiError> {
    use base64::Engine;
    let unauthorized =
        |reason: &str| ApiError::new(StatusCode::UNAUTHORIZED, "not_authorised", reason);
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            unauthorized("send HTTP basic auth credentials (e.g. curl -u user:password)")
        })?;
    let encoded = value
        .strip_prefix("Basic ")
        .ok_or_else(|| unauthorized("only HTTP basic auth is supported"))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| unauthorized("the basic auth header is not base64 of user:password"))?;
    let (name, password) = decoded
        .split_once(':')
        .ok_or_else(|| unauthorized("the basic auth header is not base64 of user:password"))?;
    broker
        .users
        .check_password(name, password, peer.ip())
        .map_err(|e| match e {
            crate::auth::AuthError::LoopbackOnly(u) => {
                unauthorized(&format!("user '{u}' can only log in from localhost"))
            }
            crate::auth::AuthError::TooManyFailures { retry_after_s } => unauthorized(&format!(
                "too many failed logins from this address; try again in {retry_after_s} s"
            )),
            _ => unauthorized("wrong user name or password"),
        })
}
