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
}

/// A member as `GET /api/overview` or `GET /api/members/{id}` reports it.
#[derive(Deserialize, Debug, Clone, Default, PartialEq)]
pub struct MemberInfo {
    /// Member id (the pod name).
    pub id: String,
    /// Zone of the member.
    #[serde(default)]
    pub zone: String,
    /// Member state.
    #[serde(default)]
    pub state: String,
    /// Queues whose primary this member is (only in `GET /api/members/{id}`).
    #[serde(default)]
    pub owned_queues: u64,
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
    /// `POST /api/members/{id}/leave`: ask a member to hand over its queues and leave.
    fn leave<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>>;
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

    fn leave<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let path = format!("/api/members/{}/leave", encode_segment(id));
            match self.call(http::Method::POST, &path, None).await? {
                (200..=204, _) | (404, _) => Ok(()),
                (status, body) => Err(self.unexpected(&path, status, &body)),
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
                (409, body) => {
                    let reason = serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(str::to_string))
                        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
                    Err(AdminError::Conflict(reason))
                }
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
