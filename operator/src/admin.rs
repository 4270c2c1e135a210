//! Client of the brokers' admin HTTP API (RabbitMQ management API paths).
//!
//! Reconcilers talk to brokers only through [`AdminApi`], so tests substitute a fake and the
//! real client ([`HttpAdmin`]) stays small: plain HTTP/1.1 over hyper, which kube already
//! brings in, with basic auth and a timeout on every call.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use serde::{Deserialize, Serialize};

/// Longest any admin call may take; a hung broker must not stall a reconcile.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Most bytes read from one admin response; the API's answers are small.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// Why an admin call failed; each message says what to check.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The broker could not be reached or did not answer in time.
    #[error(
        "admin API at {url} unreachable: {reason}; check the broker pods and the client Service"
    )]
    Unreachable {
        /// URL called.
        url: String,
        /// Transport error.
        reason: String,
    },
    /// The broker refused a declaration that conflicts with the existing queue.
    #[error("queue conflicts with the existing one: {0}; delete the queue or match its properties")]
    Conflict(String),
    /// The cluster is busy with an operation of the same kind (a rebalance under way).
    #[error("the cluster refused: {0}; wait for the operation under way")]
    Busy(String),
    /// The broker answered with an unexpected status.
    #[error("admin API {url} answered {status}: {body}")]
    Unexpected {
        /// URL called.
        url: String,
        /// HTTP status.
        status: u16,
        /// Response body (truncated).
        body: String,
    },
    /// The broker's answer was not the JSON the contract describes.
    #[error(
        "admin API {url} returned malformed JSON: {reason}; broker and operator versions may differ"
    )]
    Malformed {
        /// URL called.
        url: String,
        /// Parse error.
        reason: String,
    },
}

/// `GET /api/overview`.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct Overview {
    /// Node that answered.
    #[serde(default)]
    pub node: String,
    /// Cluster name.
    #[serde(default)]
    pub cluster_name: String,
    /// Cluster members.
    #[serde(default)]
    pub members: Vec<MemberInfo>,
    /// The consensus group as the answering member sees it; `None` (JSON `null`) when the
    /// broker runs alone, not in a cluster.
    #[serde(default)]
    pub cluster: Option<ClusterInfo>,
}

/// The `cluster` object of `GET /api/overview` (the broker's `admin/routes/overview.rs`).
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct ClusterInfo {
    /// Whether the answering member holds the majority's lease at this instant.
    #[serde(default)]
    pub quorum: bool,
    /// Voters of the consensus group, dead ones included until they are removed.
    #[serde(default)]
    pub voters: u64,
    /// Node id of the consensus leader; `None` during an election or without quorum.
    #[serde(default)]
    pub leader: Option<String>,
}

/// A member as `GET /api/overview` or `GET /api/members/{id}` reports it.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct MemberInfo {
    /// Member id (the pod name).
    pub id: String,
    /// Zone of the member.
    #[serde(default)]
    pub zone: String,
    /// Member state: `joining` (not caught up yet), `running`, or `draining`.
    #[serde(default)]
    pub state: String,
    /// On a cluster: it carries the drain mark (it takes no roles, `/readyz` answers 503),
    /// whether or not it has caught up yet.
    #[serde(default)]
    pub draining: bool,
    /// Queues whose primary this member is (only in `GET /api/members/{id}`).
    #[serde(default)]
    pub owned_queues: u64,
    /// On a cluster: queues whose primary it is, by the cluster map (any member answers
    /// the same).
    #[serde(default)]
    pub primaries: u64,
    /// On a cluster: queues it is a backup of. A member is drained when both are 0.
    #[serde(default)]
    pub backups: u64,
    /// On a cluster: of those, the ones it is in sync for (it may be promoted).
    #[serde(default)]
    pub in_sync_backups: u64,
}

/// `GET /api/cluster/rebalance` (the broker's `admin/routes/rebalance.rs`): what a
/// rebalance started now would move, and the newest one.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct RebalanceView {
    /// Nothing to move: primaries and backups even over the active members.
    #[serde(default)]
    pub balanced: bool,
    /// Primaries per active member.
    #[serde(default)]
    pub primaries: std::collections::BTreeMap<String, u64>,
    /// Backups per active member.
    #[serde(default)]
    pub backups: std::collections::BTreeMap<String, u64>,
    /// The primary moves a rebalance started now would make.
    #[serde(default)]
    pub plan: Vec<PlannedMove>,
    /// The backup moves it would make if the primaries stayed where they are.
    #[serde(default)]
    pub backup_plan: Vec<PlannedMove>,
    /// The newest rebalance; `None` before the first.
    #[serde(default)]
    pub current: Option<RebalanceProgress>,
}

/// `GET /api/cluster/ring` (the broker's `admin/routes/ring.rs`): the ring's layout as the
/// cluster map holds it (any member answers the same).
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct RingLayout {
    /// How the members are ordered.
    #[serde(default)]
    pub order: LayoutOrder,
    /// `k` of the queues declared without their own; `None`: each member's default.
    #[serde(default)]
    pub backups: Option<u8>,
    /// Agreed index of the op that set the layout (0: never): a rebalance started before it
    /// (`RebalanceProgress::started_at`) has not put the backups where it wants them.
    #[serde(default)]
    pub changed_at: u64,
    /// Node ids of the members, in ring order now.
    #[serde(default)]
    pub ring: Vec<String>,
}

/// The order of a [`RingLayout`], as the broker writes it: `"placement"`, `"zone-aware"`,
/// or the list of node ids.
#[derive(Deserialize, Serialize, Debug, Clone, PartialEq, Eq)]
#[serde(untagged)]
pub enum LayoutOrder {
    /// `"placement"` or `"zone-aware"`.
    Named(String),
    /// The node ids in ring order.
    Explicit(Vec<String>),
}

impl Default for LayoutOrder {
    fn default() -> Self {
        Self::Named("placement".into())
    }
}

/// One move of a rebalance plan.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct PlannedMove {
    /// Vhost of the queue.
    pub vhost: String,
    /// The queue.
    pub queue: String,
    /// `primary` or `backup`.
    pub kind: String,
    /// Member it moves from.
    pub from: String,
    /// Member it moves to.
    pub to: String,
}

/// A rebalance the cluster carries out, as the broker reports it.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct RebalanceProgress {
    /// `running`, `done`, `failed` or `stopped`.
    pub status: String,
    /// Moves planned.
    #[serde(default)]
    pub total: u64,
    /// Moves made.
    #[serde(default)]
    pub done: u64,
    /// Moves that could not be made.
    #[serde(default)]
    pub failed: u64,
    /// Moves not started yet.
    #[serde(default)]
    pub pending: u64,
    /// Moves under way.
    #[serde(default)]
    pub running: u64,
    /// Agreed index of the op that started it.
    #[serde(default)]
    pub started_at: u64,
    /// The new member whose join started it (the brokers' own handover); `None` for one
    /// asked for.
    #[serde(default)]
    pub joined: Option<String>,
}

impl MemberInfo {
    /// Queue roles it holds, primary or backup: what must move off before its pod goes.
    pub fn holds(&self) -> u64 {
        self.primaries.max(self.owned_queues) + self.backups
    }
}

/// `GET /api/queues/{vhost}/{name}`.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct QueueInfo {
    /// Queue name.
    pub name: String,
    /// Virtual host.
    #[serde(default)]
    pub vhost: String,
    /// Ready plus unacknowledged messages.
    #[serde(default)]
    pub messages: i64,
    /// Member owning the queue.
    #[serde(default)]
    pub owner: Option<String>,
}

/// Body of `PUT /api/queues/{vhost}/{name}`.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct QueueDeclaration {
    /// Survives a broker restart.
    pub durable: bool,
    /// Deleted with its last consumer.
    pub auto_delete: bool,
    /// AMQP arguments.
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

/// Outcome of a declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declared {
    /// 201: the queue did not exist and was created.
    Created,
    /// 204: the queue already existed with the same properties.
    AlreadyThere,
}

/// The calls reconcilers make to a cluster's brokers.
///
/// Boxed futures keep it object-safe, so the context holds `Arc<dyn AdminApi>` and tests plug
/// in a fake.
pub trait AdminApi: Send + Sync {
    /// `GET /api/overview`.
    fn overview(&self) -> BoxFuture<'_, Result<Overview, AdminError>>;
    /// `GET /api/members/{id}`; `None` when the member is unknown (already gone).
    fn member<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<MemberInfo>, AdminError>>;
    /// `POST /api/members/{id}/drain`: the cluster moves the member's primaries and
    /// backups to the others and sends its clients elsewhere (asynchronously: read
    /// [`AdminApi::member`] until it holds nothing). Any member answers; a 404 (no such
    /// member) and a 400 (a single broker, nothing to drain to) are errors.
    fn drain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>>;
    /// `POST /api/members/{id}/undrain`: the member takes roles again. A pod that a
    /// scale-down drained and removed comes back drained with a scale-up (the mark outlives
    /// the member); it serves again only once undrained. A 404 (no such member, and no
    /// mark) is an error.
    fn undrain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>>;
    /// `GET /api/cluster/rebalance`. Any member answers, the same from each; a single
    /// broker answers 400 (an error).
    fn rebalance(&self) -> BoxFuture<'_, Result<RebalanceView, AdminError>>;
    /// `POST /api/cluster/rebalance`: the cluster plans the moves and carries them out, at
    /// most `concurrency` at once (read [`AdminApi::rebalance`] to follow it). A 409 (one
    /// is under way) is [`AdminError::Busy`].
    fn start_rebalance(&self, concurrency: u32) -> BoxFuture<'_, Result<(), AdminError>>;
    /// `GET /api/cluster/ring`. Any member answers, the same from each; a single broker
    /// answers 400 (an error).
    fn ring_layout(&self) -> BoxFuture<'_, Result<RingLayout, AdminError>>;
    /// `PUT /api/cluster/ring`: every member orders the ring by `order` and gives the queues
    /// without their own `k` `backups`; no copy moves until a rebalance. The layout as
    /// committed; a 400 (a layout no ring can follow) is an error that says why.
    fn set_ring_layout<'a>(
        &'a self,
        order: &'a LayoutOrder,
        backups: Option<u8>,
    ) -> BoxFuture<'a, Result<RingLayout, AdminError>>;
    /// `GET /api/queues/{vhost}/{name}`; `None` on 404.
    fn queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueInfo>, AdminError>>;
    /// `PUT /api/queues/{vhost}/{name}`.
    fn declare_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
        declaration: &'a QueueDeclaration,
    ) -> BoxFuture<'a, Result<Declared, AdminError>>;
    /// `DELETE /api/queues/{vhost}/{name}`; `false` when it was already gone.
    fn delete_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, AdminError>>;
}

/// Where and as whom to reach a cluster's admin API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminEndpoint {
    /// Base URL, e.g. `http://ringmq.default.svc:15672`.
    pub base_url: String,
    /// User with the administrator tag.
    pub username: String,
    /// Its password.
    pub password: String,
}

/// Makes an [`AdminApi`] for an endpoint; the seam tests replace.
pub trait AdminConnector: Send + Sync {
    /// A client for `endpoint`.
    fn connect(&self, endpoint: AdminEndpoint) -> Arc<dyn AdminApi>;
}

/// Connector producing [`HttpAdmin`] clients that share one connection pool.
#[derive(Clone)]
pub struct HttpConnectorFactory {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpConnectorFactory {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(ADMIN_TIMEOUT));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Self { client }
    }
}

impl AdminConnector for HttpConnectorFactory {
    fn connect(&self, endpoint: AdminEndpoint) -> Arc<dyn AdminApi> {
        Arc::new(HttpAdmin {
            client: self.client.clone(),
            endpoint,
        })
    }
}

/// The real admin client.
pub struct HttpAdmin {
    client: Client<HttpConnector, Full<Bytes>>,
    endpoint: AdminEndpoint,
}

/// Percent-encodes one path segment (vhost `/` becomes `%2F`), as the API requires.
pub fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl HttpAdmin {
    async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes), AdminError> {
        let url = format!("{}{}", self.endpoint.base_url.trim_end_matches('/'), path);
        let unreachable = |reason: String| AdminError::Unreachable {
            url: url.clone(),
            reason,
        };
        let credentials = base64::engine::general_purpose::STANDARD.encode(format!(
            "{}:{}",
            self.endpoint.username, self.endpoint.password
        ));
        let mut builder = http::Request::builder()
            .method(method)
            .uri(&url)
            .header(http::header::AUTHORIZATION, format!("Basic {credentials}"))
            .header(http::header::ACCEPT, "application/json");
        if body.is_some() {
            builder = builder.header(http::header::CONTENT_TYPE, "application/json");
        }
        let request = builder
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| unreachable(e.to_string()))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let status = response.status().as_u16();
            let limited = http_body_util::Limited::new(response.into_body(), MAX_RESPONSE_BYTES);
            let bytes = limited
                .collect()
                .await
                .map_err(|e| unreachable(e.to_string()))?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(ADMIN_TIMEOUT, exchange)
            .await
            .map_err(|_| unreachable(format!("no answer within {}s", ADMIN_TIMEOUT.as_secs())))?
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.endpoint.base_url.trim_end_matches('/'), path)
    }

    fn unexpected(&self, path: &str, status: u16, body: &Bytes) -> AdminError {
        let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        AdminError::Unexpected {
            url: self.url(path),
            status,
            body: text,
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &Bytes,
    ) -> Result<T, AdminError> {
        serde_json::from_slice(body).map_err(|e| AdminError::Malformed {
            url: self.url(path),
            reason: e.to_string(),
        })
    }
}

/// The `reason` of an error answer, else its text.
fn reason(body: &Bytes) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

fn queue_path(vhost: &str, name: &str) -> String {
    format!(
        "/api/queues/{}/{}",
        encode_segment(vhost),
        encode_segment(name)
    )
}

impl AdminApi for HttpAdmin {
    fn overview(&self) -> BoxFuture<'_, Result<Overview, AdminError>> {
        Box::pin(async move {
            let path = "/api/overview";
            match self.call(http::Method::GET, path, None).await? {
                (200, body) => self.parse(path, &body),
                (status, body) => Err(self.unexpected(path, status, &body)),
            }
        })
    }

    fn member<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<MemberInfo>, AdminError>> {
        Box::pin(async move {
            let path = format!("/api/members/{}", encode_segment(id));
            match self.call(http::Method::GET, &path, None).await? {
                (200, body) => self.parse(&path, &body).map(Some),
                (404, _) => Ok(None),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }

    fn drain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let path = format!("/api/members/{}/drain", encode_segment(id));
            match self.call(http::Method::POST, &path, None).await? {
                (200..=204, _) => Ok(()),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }

    fn undrain<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let path = format!("/api/members/{}/undrain", encode_segment(id));
            match self.call(http::Method::POST, &path, None).await? {
                (200..=204, _) => Ok(()),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }

    fn rebalance(&self) -> BoxFuture<'_, Result<RebalanceView, AdminError>> {
        Box::pin(async move {
            let path = "/api/cluster/rebalance";
            match self.call(http::Method::GET, path, None).await? {
                (200, body) => self.parse(path, &body),
                (status, body) => Err(self.unexpected(path, status, &body)),
            }
        })
    }

    fn start_rebalance(&self, concurrency: u32) -> BoxFuture<'_, Result<(), AdminError>> {
        Box::pin(async move {
            let path = "/api/cluster/rebalance";
            let body = serde_json::json!({ "concurrency": concurrency }).to_string();
            match (self.call(http::Method::POST, path, Some(body.into_bytes()))).await? {
                (202, _) => Ok(()),
                (409, body) => Err(AdminError::Busy(reason(&body))),
                (status, body) => Err(self.unexpected(path, status, &body)),
            }
        })
    }

    fn ring_layout(&self) -> BoxFuture<'_, Result<RingLayout, AdminError>> {
        Box::pin(async move {
            let path = "/api/cluster/ring";
            match self.call(http::Method::GET, path, None).await? {
                (200, body) => self.parse(path, &body),
                (status, body) => Err(self.unexpected(path, status, &body)),
            }
        })
    }

    fn set_ring_layout<'a>(
        &'a self,
        order: &'a LayoutOrder,
        backups: Option<u8>,
    ) -> BoxFuture<'a, Result<RingLayout, AdminError>> {
        Box::pin(async move {
            let path = "/api/cluster/ring";
            let body = serde_json::json!({ "order": order, "backups": backups }).to_string();
            match (self.call(http::Method::PUT, path, Some(body.into_bytes()))).await? {
                (202, body) => self.parse(path, &body),
                (status, body) => Err(self.unexpected(path, status, &body)),
            }
        })
    }

    fn queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<QueueInfo>, AdminError>> {
        Box::pin(async move {
            let path = queue_path(vhost, name);
            match self.call(http::Method::GET, &path, None).await? {
                (200, body) => self.parse(&path, &body).map(Some),
                (404, _) => Ok(None),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }

    fn declare_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
        declaration: &'a QueueDeclaration,
    ) -> BoxFuture<'a, Result<Declared, AdminError>> {
        Box::pin(async move {
            let path = queue_path(vhost, name);
            let body = serde_json::to_vec(declaration).map_err(|e| AdminError::Malformed {
                url: self.url(&path),
                reason: e.to_string(),
            })?;
            match self.call(http::Method::PUT, &path, Some(body)).await? {
                (201, _) => Ok(Declared::Created),
                (204, _) => Ok(Declared::AlreadyThere),
                (409, body) => Err(AdminError::Conflict(reason(&body))),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }

    fn delete_queue<'a>(
        &'a self,
        vhost: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<bool, AdminError>> {
        Box::pin(async move {
            let path = queue_path(vhost, name);
            match self.call(http::Method::DELETE, &path, None).await? {
                (200..=204, _) => Ok(true),
                (404, _) => Ok(false),
                (status, body) => Err(self.unexpected(&path, status, &body)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    //! The real client against a tiny local HTTP stub on 127.0.0.1, until a real broker's
    //! admin API exists to test against.

    use std::sync::{Arc, Mutex};

    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    use super::*;

    type Log = Arc<Mutex<Vec<(String, String, String, String)>>>;

    /// Serves scripted answers by `METHOD path`; records method, path, auth header and body.
    async fn stub() -> (String, Log) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let log: Log = Arc::default();
        let server_log = log.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = server_log.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let log = log.clone();
                        async move {
                            let method = req.method().to_string();
                            let path = req.uri().path().to_string();
                            let auth = req
                                .headers()
                                .get(http::header::AUTHORIZATION)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_string();
                            let body = req
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let body = String::from_utf8_lossy(&body).into_owned();
                            log.lock().expect("log").push((
                                method.clone(),
                                path.clone(),
                                auth,
                                body,
                            ));
                            let (status, reply) = match (method.as_str(), path.as_str()) {
                                ("GET", "/api/overview") => (
                                    200,
                                    r#"{"node":"ringmq-0","cluster_name":"c","members":[{"id":"ringmq-0","amqp":"a","admin":"b","zone":"z1","state":"up"}]}"#,
                                ),
                                ("PUT", "/api/queues/%2F/new") => (201, ""),
                                ("PUT", "/api/queues/%2F/same") => (204, ""),
                                ("PUT", "/api/queues/%2F/other") => (
                                    409,
                                    r#"{"error":"conflict","reason":"inequivalent arg 'durable'"}"#,
                                ),
                                ("GET", "/api/queues/%2F/same") => (
                                    200,
                                    r#"{"name":"same","vhost":"/","durable":true,"auto_delete":false,"exclusive":false,"arguments":{},"messages_ready":3,"messages_unacknowledged":1,"messages":4,"consumers":0,"owner":"ringmq-2"}"#,
                                ),
                                ("DELETE", "/api/queues/%2F/same") => (204, ""),
                                ("GET", "/api/members/ringmq-1") => {
                                    (200, r#"{"id":"ringmq-1","owned_queues":5}"#)
                                }
                                ("POST", "/api/members/ringmq-1/drain") => (202, ""),
                                ("GET", "/api/overview-broken") => (200, "not json"),
                                _ => (404, r#"{"error":"not_found","reason":"no such thing"}"#),
                            };
                            hyper::Response::builder()
                                .status(status)
                                .body(Full::new(Bytes::from(reply)))
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (format!("http://{addr}"), log)
    }

    fn client(base_url: String) -> Arc<dyn AdminApi> {
        HttpConnectorFactory::default().connect(AdminEndpoint {
            base_url,
            username: "admin".into(),
            password: "s3cret".into(),
        })
    }

    #[tokio::test]
    async fn http_client_speaks_the_admin_api_contract() {
        let (url, log) = stub().await;
        let admin = client(url);
        let overview = admin.overview().await.expect("overview");
        assert_eq!(overview.members[0].zone, "z1");

        let decl = QueueDeclaration {
            durable: true,
            auto_delete: false,
            arguments: serde_json::Map::new(),
        };
        assert_eq!(
            admin.declare_queue("/", "new", &decl).await.expect("201"),
            Declared::Created
        );
        assert_eq!(
            admin.declare_queue("/", "same", &decl).await.expect("204"),
            Declared::AlreadyThere
        );
        match admin.declare_queue("/", "other", &decl).await {
            Err(AdminError::Conflict(reason)) => assert_eq!(reason, "inequivalent arg 'durable'"),
            other => panic!("want conflict, got {other:?}"),
        }
        let info = admin
            .queue("/", "same")
            .await
            .expect("get")
            .expect("present");
        assert_eq!(
            (info.messages, info.owner.as_deref()),
            (4, Some("ringmq-2"))
        );
        assert_eq!(
            admin
                .queue("/", "missing")
                .await
                .expect("404 is not an error"),
            None
        );
        assert!(admin.delete_queue("/", "same").await.expect("204"));
        assert!(
            !admin
                .delete_queue("/", "missing")
                .await
                .expect("404 is not an error")
        );
        assert_eq!(
            admin
                .member("ringmq-1")
                .await
                .expect("member")
                .map(|m| m.owned_queues),
            Some(5)
        );
        assert_eq!(
            admin.member("ringmq-9").await.expect("404 is not an error"),
            None
        );
        admin.drain("ringmq-1").await.expect("202");
        admin
            .drain("ringmq-9")
            .await
            .expect_err("a 404 is no drain: the member is not there");

        let log = log.lock().expect("log");
        let expected_auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("admin:s3cret")
        );
        assert!(
            log.iter().all(|(_, _, auth, _)| *auth == expected_auth),
            "basic auth on every call"
        );
        let put = log
            .iter()
            .find(|(m, p, _, _)| m == "PUT" && p == "/api/queues/%2F/new")
            .expect("PUT seen");
        let body: serde_json::Value = serde_json::from_str(&put.3).expect("JSON body");
        assert_eq!(
            body,
            serde_json::json!({"durable": true, "auto_delete": false, "arguments": {}})
        );
    }

    #[tokio::test]
    async fn unreachable_and_malformed_answers_become_errors_that_say_what_to_check() {
        // A port nothing listens on: bind then drop.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let admin = client(format!("http://127.0.0.1:{port}"));
        let err = admin.overview().await.expect_err("nothing listens");
        assert!(matches!(err, AdminError::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("check the broker pods"));

        let (url, _log) = stub().await;
        let admin = HttpAdmin {
            client: HttpConnectorFactory::default().client,
            endpoint: AdminEndpoint {
                base_url: url,
                username: "a".into(),
                password: "b".into(),
            },
        };
        let (status, body) = admin
            .call(http::Method::GET, "/api/overview-broken", None)
            .await
            .expect("answer");
        assert_eq!(status, 200);
        let err = admin
            .parse::<Overview>("/api/overview-broken", &body)
            .expect_err("not JSON");
        assert!(matches!(err, AdminError::Malformed { .. }));
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(encode_segment("/"), "%2F");
        assert_eq!(encode_segment("orders.eu-1"), "orders.eu-1");
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }
}
